"""`pagoda health ADDR | --service NAME`: probe a control socket; exit 0 when it says ok.

Compose health checks run it inside each container (PAGODA_CONTROL_ADDR names the container's
own control socket); by hand it shows any process's status and details.
"""
import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("addr", nargs="?", default=None,
                        help="a control address (tcp://host:port or ipc://path)")
    parser.add_argument("--service", default=None,
                        help="probe this service's control socket from the stack's "
                             "configuration (PAGODA_* environment or the run directory)")
    parser.add_argument("--instance", default="0", help="the instance (or worker rank) of --service")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.add_argument("--curve-keys-dir", default=None,
                        help="the stack's CurveZMQ keys (default: PAGODA_CURVE_KEYS_DIR)")


def run(args: argparse.Namespace) -> int:
    from shared.curve import CurveKeysError
    from shared.sockets import probe_health
    from shared.stack_config import StackConfig
    if (args.addr is None) == (args.service is None):
        raise SystemExit("pagoda health: give a control address or --service NAME (one of them)")
    stack = StackConfig(curve_keys_dir=args.curve_keys_dir or "")
    addr = args.addr or stack.control_for(args.service, args.instance)
    try:
        curve = stack.curve
    except CurveKeysError as e:
        print(f"pagoda health: {e}")
        return 1
    health = probe_health(addr, timeout_s=args.timeout, curve=curve)
    if health is None:
        print(f"{addr}: no answer within {args.timeout:g} s")
        return 1
    if args.json:
        print(json.dumps({"addr": addr, "service": health.service, "status": health.status,
                          "details": health.details}))
    else:
        details = " ".join(f"{k}={v}" for k, v in health.details.items())
        print(f"{health.service} {health.status} ({addr}) {details}")
    return 0 if health.status == "ok" else 1
