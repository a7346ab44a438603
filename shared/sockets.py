"""ZeroMQ helpers every service uses: binding, connecting, control sockets, health probes.

`bind` and `connect` also apply CurveZMQ when the stack has keys (`shared.curve`); sockets
are bound and connected through them only, so none is left in the clear.
"""
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from proto.codec import CodecError, decode, encode
from proto.requests import ErrorResponse, HealthRequest, HealthResponse
from shared.curve import CurveKeys, process_keys, secure_client, secure_server
from shared.logging import get_logger

log = get_logger("sockets")

# Tells one start of a process from the next: a restarted container keeps its hostname and,
# in a fresh pid namespace, often its pid too.
BOOT_ID = uuid.uuid4().hex


def free_tcp_ports(host: str, count: int = 1) -> list[int]:
    """`count` different tcp ports of `host` that nothing listened on a moment ago (all probed
    at once, so that they differ; another process may still take one before it is bound)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def process_instance_id() -> str:
    """This process's name towards its peers: host, pid and boot id."""
    return f"{socket.gethostname()}-{os.getpid()}-{BOOT_ID[:8]}"


def ipc_path(addr: str) -> str | None:
    return addr[len("ipc://"):] if addr.startswith("ipc://") else None


def bind_address(addr: str) -> str:
    """What to bind for an address that others connect to. A tcp address may name this host by
    a service name (`tcp://engine:5555` inside compose): bind that port on every interface of
    the container then. Literal IPs (127.0.0.1 by default) are bound as given."""
    if not addr.startswith("tcp://"):
        return addr
    host, _, port = addr[len("tcp://"):].rpartition(":")
    if host in ("*", "0.0.0.0", "localhost") or host.startswith("[") or _is_ip(host):
        return f"tcp://{'*' if host == '0.0.0.0' else host}:{port}"
    return f"tcp://*:{port}"


def _is_ip(host: str) -> bool:
    import ipaddress
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def bind(sock: zmq.Socket, addr: str, curve: CurveKeys | None = None) -> None:
    """Bind, creating the ipc directory and replacing a stale socket file left by a dead run.
    With CURVE keys (`curve`, else this process's) the socket is a CURVE server."""
    _secure(sock, curve, server=True)
    path = ipc_path(addr)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)
    sock.bind(bind_address(addr))


def bind_random_port(sock: zmq.Socket, host: str, curve: CurveKeys | None = None) -> str:
    """Bind a free tcp port of `host`; returns the address peers connect to."""
    _secure(sock, curve, server=True)
    port = sock.bind_to_random_port(bind_address(f"tcp://{host}:0").rsplit(":", 1)[0])
    return f"tcp://{host}:{port}"


def connect(sock: zmq.Socket, addr: str, curve: CurveKeys | None = None) -> None:
    """Connect; with CURVE keys (`curve`, else this process's) as a CURVE client."""
    _secure(sock, curve, server=False)
    sock.connect(addr)


def _secure(sock: zmq.Socket, curve: CurveKeys | None, server: bool) -> None:
    # Security options count only when set before the bind or connect.
    keys = curve or process_keys()
    if keys is not None:
        (secure_server if server else secure_client)(sock, keys)


def unlink_ipc(*addrs: str) -> None:
    for addr in addrs:
        path = ipc_path(addr)
        if path and os.path.exists(path):
            try:
                os.unlink(path)
            except OSError:
                pass


def make_socket(ctx: zmq.Context, kind: int, linger_ms: int = 0, hwm: int = 100_000) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


class ControlServer:
    """Answers health probes on a process's control socket, from a background thread.

    `status_fn()` returns (status, details): "ok" once the service is ready to serve.
    """

    def __init__(self, ctx: zmq.Context, addr: str, service: str,
                 status_fn: Callable[[], tuple[str, dict]], curve: CurveKeys | None = None):
        self.addr = addr
        self.service = service
        self.status_fn = status_fn
        self.sock = make_socket(ctx, zmq.REP)
        bind(self.sock, addr, curve)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"{service}-control", daemon=True)
        self.started = time.time()

    def start(self) -> "ControlServer":
        self.thread.start()
        return self

    def _serve(self) -> None:
        from shared.placement import spread_this_thread
        spread_this_thread()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                frame = self.sock.recv()
            except zmq.ZMQError:
                return  # the socket was closed at shutdown
            try:
                decode(frame, HealthRequest)
                status, details = self.status_fn()
                details = {"uptime_s": round(time.time() - self.started, 1), "pid": os.getpid(),
                           "boot_id": BOOT_ID, **details}
                reply = encode(HealthResponse(self.service, status, details))
            except CodecError as e:
                log.warning("bad control frame", error=str(e))
                reply = encode(ErrorResponse(None, 400, f"bad control frame: {e}"))
            except Exception as e:  # a status callback must never kill the control thread
                log.exception("health status failed")
                reply = encode(HealthResponse(self.service, "degraded",
                                              {"pid": os.getpid(), "boot_id": BOOT_ID,
                                               "error": str(e)}))
            try:
                self.sock.send(reply)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=1)
        self.sock.close(0)
        unlink_ipc(self.addr)


def probe_health(addr: str, timeout_s: float = 1.0, ctx: zmq.Context | None = None,
                 curve: CurveKeys | None = None) -> HealthResponse | None:
    """Ask a control socket for its health; None when nobody answers in time (or, on a
    stack with CURVE keys, when this side has no authorized key)."""
    ctx = ctx or zmq.Context.instance()
    sock = make_socket(ctx, zmq.REQ)
    try:
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        connect(sock, addr, curve)
        sock.send(encode(HealthRequest()))
        return decode(sock.recv(), HealthResponse)
    except (zmq.ZMQError, CodecError):
        return None
    finally:
        sock.close(0)


class PushRoutes:
    """PUSH sockets to return addresses (a client's gateway id), connected on first use."""

    def __init__(self, ctx: zmq.Context, max_routes: int = 256, curve: CurveKeys | None = None):
        self.ctx = ctx
        self.max_routes = max_routes
        self.curve = curve
        self.socks: dict[str, zmq.Socket] = {}

    def send(self, addr: str, frame: bytes) -> bool:
        sock = self.socks.get(addr)
        if sock is None:
            if len(self.socks) >= self.max_routes:  # forget the oldest route
                old = next(iter(self.socks))
                self.socks.pop(old).close(0)
            sock = make_socket(self.ctx, zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, 0)
            try:
                connect(sock, addr, self.curve)
            except zmq.ZMQError as e:
                log.warning("bad return address", addr=addr, error=str(e))
                sock.close(0)
                return False
            self.socks[addr] = sock
        try:
            sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False  # the client is gone or far behind: its outputs are dropped

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(0)
        self.socks.clear()
