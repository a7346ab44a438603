"""GatewayHeartbeat: a client's sign of life to the engine, which aborts the requests of a
client whose heartbeats stop (its process died)."""
import contextlib
import threading

import zmq

from proto.codec import encode
from proto.control import Register
from shared.sockets import connect, make_socket
from shared.stack_config import StackConfig


class GatewayHeartbeat:
    """Tells the engine this client is alive, from a thread of its own (a busy event loop is
    not a dead process): the engine aborts a client's requests when its heartbeats stop."""

    def __init__(self, stack: StackConfig, gateway_id: str, curve):
        self.stack = stack
        self.frame = encode(Register("gateway", gateway_id, heartbeat=True))
        self.curve = curve
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gateway-heartbeat",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        ctx = zmq.Context()
        socks = []  # one per engine replica: each one must see the beats
        for addr in self.stack.replica_addresses("engine_input"):
            sock = make_socket(ctx, zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no beats queued up for an engine that is away
            connect(sock, addr, self.curve)
            socks.append(sock)
        try:
            while True:
                for sock in socks:
                    with contextlib.suppress(zmq.Again):
                        sock.send(self.frame, zmq.NOBLOCK)
                if self._stop.wait(self.stack.liveness_timeout_s / 4):
                    return
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
