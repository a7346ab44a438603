"""Optional CurveZMQ on the stack's sockets: encryption, and only known keys may connect.

A key directory (made by `pagoda keys DIR`) holds

    server.key, server.key_secret   the keypair of every socket that binds
    client.key, client.key_secret   the keypair of every socket that connects
    authorized/*.key                the public keys allowed to connect (client.key to start with)

With a key directory set (`--curve-keys-dir` or PAGODA_CURVE_KEYS_DIR), `shared.sockets.bind`
makes a socket a CURVE server and `shared.sockets.connect` a CURVE client of the server key.
Each context with a CURVE server runs a ZAP handler that admits a peer only when it proves a
key from authorized/; a peer without keys, or with any other key, exchanges nothing.

The ZAP handler is a thread of our own rather than pyzmq's ThreadAuthenticator: that one keeps
its sockets open until `stop()` is called, so the `ctx.term()` every service does at shutdown
would hang. Ours blocks in `recv` and ends when its context is terminated.
"""
import os
import stat
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.utils import z85

from shared.logging import get_logger

log = get_logger("curve")

SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (ZAP, RFC 27)


class CurveKeysError(RuntimeError):
    """A key directory that is missing, unreadable or incomplete; the message names the path."""


@dataclass(frozen=True)
class CurveKeys:
    keys_dir: str
    server_public: bytes  # z85, as zmq's socket options take them
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized: frozenset[bytes]  # raw 32-byte public keys (what ZAP requests carry)


def create_keys(keys_dir: str) -> CurveKeys:
    """Write a new key directory, readable by its owner only; refuses to replace keys."""
    keys_dir = os.path.abspath(keys_dir)
    if os.path.exists(os.path.join(keys_dir, SERVER + ".key_secret")):
        raise CurveKeysError(f"{keys_dir} already holds keys; remove them first to make new ones")
    authorized = os.path.join(keys_dir, AUTHORIZED)
    os.makedirs(authorized, exist_ok=True)
    # The folders first: nobody else can open what is written inside them from now on.
    for folder in (keys_dir, authorized):
        os.chmod(folder, 0o700)
    zmq.auth.create_certificates(keys_dir, SERVER)
    client_public, _ = zmq.auth.create_certificates(keys_dir, CLIENT)
    with open(client_public, "rb") as src, open(os.path.join(authorized, CLIENT + ".key"),
                                                 "wb") as dst:
        dst.write(src.read())
    for folder in (keys_dir, authorized):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                os.chmod(path, 0o600)
    return load_keys(keys_dir)


_loaded: dict[str, CurveKeys] = {}
_load_lock = threading.Lock()


def load_keys(keys_dir: str) -> CurveKeys:
    """The keys of a directory, read once per process; CurveKeysError names what is wrong."""
    keys_dir = os.path.abspath(keys_dir)
    with _load_lock:
        if keys_dir not in _loaded:
            _loaded[keys_dir] = _read_keys(keys_dir)
        return _loaded[keys_dir]


def _read_keys(keys_dir: str) -> CurveKeys:
    hint = f"(create one with `pagoda keys {keys_dir}`)"
    if not os.path.isdir(keys_dir):
        raise CurveKeysError(f"CURVE key directory {keys_dir} does not exist {hint}")

    def keypair(name: str) -> tuple[bytes, bytes]:
        path = os.path.join(keys_dir, name + ".key_secret")
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise CurveKeysError(f"CURVE key file {path} cannot be read: {e} {hint}") from None
        if not secret:
            raise CurveKeysError(f"CURVE key file {path} holds no secret key {hint}")
        if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("a CURVE secret key is readable by others", path=path)
        return public, secret

    server_public, server_secret = keypair(SERVER)
    client_public, client_secret = keypair(CLIENT)
    folder = os.path.join(keys_dir, AUTHORIZED)
    try:
        authorized = frozenset(z85.decode(k) for k in zmq.auth.load_certificates(folder))
    except (OSError, ValueError) as e:
        raise CurveKeysError(f"CURVE authorized keys in {folder} cannot be read: {e} "
                             f"{hint}") from None
    if not authorized:
        raise CurveKeysError(f"no authorized CURVE keys (*.key) in {folder} {hint}")
    return CurveKeys(keys_dir, server_public, server_secret, client_public, client_secret,
                     authorized)


# -- this process's keys ---------------------------------------------------------------------
_process_dir: str | None = None  # set by `use`; None: PAGODA_CURVE_KEYS_DIR decides


def use(keys_dir: str) -> CurveKeys | None:
    """Set this process's key directory ("": CURVE off) and load it now, so that a bad one
    fails at start. A service does this with its `--curve-keys-dir`/PAGODA_CURVE_KEYS_DIR."""
    global _process_dir
    keys = load_keys(keys_dir) if keys_dir else None
    _process_dir = keys_dir
    return keys


def process_keys() -> CurveKeys | None:
    """The keys the socket helpers use when given none; None when CURVE is off."""
    keys_dir = _process_dir if _process_dir is not None else os.environ.get(
        "PAGODA_CURVE_KEYS_DIR", "")
    return load_keys(keys_dir) if keys_dir else None


# -- sockets ---------------------------------------------------------------------------------
def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE server whose peers must hold an authorized key (before it binds)."""
    start_authenticator(sock.context, keys)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE client of the stack's server key (before it connects)."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)


# id(context) -> its handler; the handler holds the context, so an id is not reused meanwhile.
_authenticators: dict[int, "ZapHandler"] = {}
_auth_lock = threading.Lock()


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> "ZapHandler":
    """The ZAP handler of `ctx` (sync or asyncio), started on first use."""
    with _auth_lock:
        handler = _authenticators.get(id(ctx))
        if handler is None:
            handler = ZapHandler(ctx, keys.authorized)
            _authenticators[id(ctx)] = handler
            handler.start()
        elif handler.authorized != keys.authorized:
            raise CurveKeysError("one ZeroMQ context cannot serve two key directories")
        return handler


class ZapHandler(threading.Thread):
    """Answers libzmq's ZAP requests for one context: CURVE with an authorized key, or no."""

    def __init__(self, ctx: zmq.Context, authorized: frozenset[bytes]):
        super().__init__(name="curve-zap", daemon=True)
        self.ctx = ctx
        self.authorized = authorized
        # Built directly, not by ctx.socket(): a context's destroy() closes the sockets it made,
        # from its own thread, while this one may be blocked in recv on it.
        self.sock = zmq.Socket(ctx, zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(_ZAP_ENDPOINT)  # here, so no handshake can come before the handler
        self.denied = 0
        self._last_warning = 0.0

    def run(self) -> None:
        try:
            while True:
                try:
                    request = self.sock.recv_multipart()
                except zmq.ContextTerminated:
                    return
                self.sock.send_multipart(self._answer(request))
        except zmq.ZMQError as e:
            if e.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                log.error("the CURVE authenticator stopped", error=str(e))
        finally:
            self.sock.close(0)
            with _auth_lock:
                if _authenticators.get(id(self.ctx)) is self:
                    del _authenticators[id(self.ctx)]

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, identity, mechanism, credentials...
        request_id = request[1] if len(request) > 1 else b""
        ok = (len(request) == 7 and request[0] == b"1.0" and request[5] == b"CURVE"
              and request[6] in self.authorized)
        if not ok:
            self.denied += 1
            # A refused peer reconnects every moment: one line per 10 s is enough.
            if time.monotonic() - self._last_warning > 10:
                self._last_warning = time.monotonic()
                address = request[3].decode(errors="replace") if len(request) > 3 else "?"
                log.warning("refused a ZeroMQ peer without an authorized CURVE key",
                            peer=address or "local", refused=self.denied)
        return [b"1.0", request_id, b"200" if ok else b"400",
                b"OK" if ok else b"unknown key", b"", b""]
