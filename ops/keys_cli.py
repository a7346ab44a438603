"""`pagoda keys DIR`: make the CurveZMQ keys of a stack whose services talk across hosts.

Every service then gets the directory (mounted read-only) and PAGODA_CURVE_KEYS_DIR=DIR (or
`--curve-keys-dir DIR`): its sockets are encrypted, and only holders of a key in
DIR/authorized/ can connect to what it binds.
"""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="the key directory to create (made readable by you only)")


def run(args: argparse.Namespace) -> int:
    from shared.curve import CurveKeysError, create_keys
    try:
        keys = create_keys(args.dir)
    except (CurveKeysError, OSError) as e:
        print(f"pagoda keys: {e}")
        return 1
    print(f"CurveZMQ keys in {keys.keys_dir}:\n"
          f"  server.key, server.key_secret   every socket that binds\n"
          f"  client.key, client.key_secret   every socket that connects\n"
          f"  authorized/client.key           public keys allowed to connect\n"
          f"Give every service this directory and PAGODA_CURVE_KEYS_DIR={keys.keys_dir}.")
    return 0
