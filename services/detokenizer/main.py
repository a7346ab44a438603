"""`pagoda detokenizer`: token deltas in (from the engine), text deltas out (to each client).

Start M of them with the same addresses; the engine sends all of a request's deltas to one.
With several engine replicas (data parallelism) each detokenizer registers with every one (a
DEALER per replica) and tells a request's end to the replica that sent its deltas.
"""
import argparse
import contextlib
import signal
import time

import zmq

from proto.codec import CodecError, decode, encode
from proto.control import Register
from proto.requests import FinishRequest, RequestTextDelta, TextDeltas, TokenDeltas
from shared.engine_args import EngineArgs
from shared.gc_freeze import freeze_startup_objects
from shared.logging import configure, get_logger
from shared.sockets import (ControlServer, PushRoutes, connect, make_socket,
                            process_instance_id)
from shared.stack_config import StackConfig
from shared.tokenizer import get_tokenizer
from services.detokenizer.detokenize import Detokenizer

log = get_logger("detokenizer")

# A request with no delta for this long is forgotten: the engine moved it elsewhere or is gone
# (a request waiting in a long queue gets no deltas meanwhile, so this is generous).
_IDLE_REQUEST_S = 900.0
# The longest wait for output: SIGTERM only sets a flag, and a zmq poll the signal interrupts
# resumes waiting, so a poll as long as the heartbeat period (a quarter of the liveness
# timeout: 15 s at 60 s) held the stop back past the launcher's grace period.
_STOP_CHECK_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance", default="0", help="names this process's control socket")
    # The engine flags are accepted so every service takes one command line; only the
    # tokenizer's location is used here.
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    configure("detokenizer")
    DetokenizerService(args.tokenizer or args.model, StackConfig.from_cli_args(args),
                       args.instance).serve()
    return 0


class DetokenizerService:
    def __init__(self, tokenizer_path: str | None, stack: StackConfig, instance: str = "0"):
        self.stack = stack
        self.instance_id = process_instance_id()
        self.ctx = zmq.Context()
        self.status = "starting"
        self.steps = 0
        self.detokenizer: Detokenizer | None = None
        self.control = ControlServer(self.ctx, stack.control_for("detokenizer", instance),
                                     "detokenizer", self._health).start()
        self.detokenizer = Detokenizer(get_tokenizer(tokenizer_path))
        # One DEALER per replica: each replica's engine must see this one's heartbeats.
        self.engines, self.engine_inputs = [], []
        for addr, input_addr in zip(stack.replica_addresses("detokenizer_addr"),
                                    stack.replica_addresses("engine_input")):
            sock = make_socket(self.ctx, zmq.DEALER)
            sock.setsockopt_string(zmq.IDENTITY, f"detok-{self.instance_id}")
            connect(sock, addr)
            self.engines.append(sock)
            sock = make_socket(self.ctx, zmq.PUSH)
            connect(sock, input_addr)
            self.engine_inputs.append(sock)
        self.poller = zmq.Poller()
        for sock in self.engines:
            self.poller.register(sock, zmq.POLLIN)
        self.routes = PushRoutes(self.ctx)
        self._stop = False
        self.status = "ok"

    def _health(self) -> tuple[str, dict]:
        requests = len(self.detokenizer.requests) if self.detokenizer is not None else 0
        return self.status, {"requests": requests, "steps": self.steps}

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_stop", True))
        heartbeat_every = self.stack.liveness_timeout_s / 4
        last_beat = last_sweep = 0.0
        log.info("detokenizer ready", engine=self.stack.detokenizer_addr,
                 frozen_objects=freeze_startup_objects())
        try:
            while not self._stop:
                if time.monotonic() - last_beat > heartbeat_every:
                    beat = encode(Register("detokenizer", self.instance_id))
                    for sock in self.engines:
                        # Never blocks: a replica long away must not stop the others' text.
                        with contextlib.suppress(zmq.Again):
                            sock.send(beat, zmq.NOBLOCK)
                    last_beat = time.monotonic()
                if time.monotonic() - last_sweep > 60:
                    last_sweep = time.monotonic()
                    if forgotten := self.detokenizer.forget_idle(_IDLE_REQUEST_S):
                        log.info("forgot idle requests", requests=forgotten)
                ready = dict(self.poller.poll(int(min(heartbeat_every, _STOP_CHECK_S) * 1000)))
                for replica, sock in enumerate(self.engines):
                    if sock in ready:
                        self._handle(sock.recv(), replica)
        finally:
            self.control.close()
            for sock in self.engines + self.engine_inputs:
                sock.close(0)
            self.routes.close()
            self.ctx.term()

    def _handle(self, frame: bytes, replica: int = 0) -> None:
        try:
            msg = decode(frame, TokenDeltas)
        except CodecError as e:
            log.warning("dropped a bad frame", error=str(e), size=len(frame))
            return
        self.steps += 1
        by_gateway: dict[str, list[RequestTextDelta]] = {}
        finished_here = []
        for delta in msg.requests:
            if any(sd.finish_reason == "abort" for sd in delta.sequences):
                # No text for an aborted request: nobody reads it (the client left).
                if (text_delta := self.detokenizer.end_aborted(delta)) is not None:
                    by_gateway.setdefault(delta.gateway_id, []).append(text_delta)
                continue
            try:
                text_delta, tell_engine = self.detokenizer.decode(delta)
            except Exception:  # one bad request must not stop the others' streams
                log.exception("detokenization failed", request_id=delta.request_id)
                self.detokenizer.forget(delta.request_id)
                continue
            if text_delta is None:
                log.warning("delta for an unknown request", request_id=delta.request_id)
                continue
            by_gateway.setdefault(delta.gateway_id, []).append(text_delta)
            if tell_engine:
                finished_here.append(delta.request_id)
        for gateway, deltas in by_gateway.items():
            self.routes.send(gateway, encode(TextDeltas(deltas)))
        if finished_here:
            self.engine_inputs[replica].send(encode(FinishRequest(finished_here, "stop string")))
