"""`pagoda tokenizer`: a stateless process that turns GenerateRequests into EngineRequests.

Start as many as you like with the same addresses: each connects to the engine's front door
(PULL, round robin) and pushes to the engine's input. With several engine replicas (data
parallelism) it connects to every replica's front door and pushes each request to the input of
the replica its client chose (`GenerateRequest.replica`).
"""
import argparse
import signal
import time

import zmq

from proto.codec import CodecError, decode, encode
from proto.control import Register
from proto.requests import AbortRequest, ErrorResponse, GenerateRequest
from shared.chat_template import load_chat_template
from shared.engine_args import EngineArgs
from shared.gc_freeze import freeze_startup_objects
from shared.logging import configure, get_logger
from shared.recent_ids import RecentIds
from shared.sockets import (ControlServer, PushRoutes, connect, make_socket,
                            process_instance_id)
from shared.stack_config import StackConfig
from shared.tokenizer import get_tokenizer
from services.tokenizer.backlog import Backlog
from services.tokenizer.tokenize import PromptChecks, RequestRejected, RequestTokenizer

log = get_logger("tokenizer")

_READ_AHEAD = 256  # requests read off the socket ahead of tokenizing (aborts can drop them)
_ABORTS_REMEMBERED_S = 120.0
# The longest wait for input: SIGTERM only sets a flag, and a zmq poll the signal interrupts
# resumes waiting, so a poll as long as the heartbeat period (a quarter of the liveness
# timeout: 15 s at 60 s) held the stop back past the launcher's grace period.
_STOP_CHECK_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance", default="0", help="names this process's control socket")
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    configure("tokenizer")
    TokenizerService(EngineArgs.from_cli_args(args), StackConfig.from_cli_args(args),
                     args.instance).serve()
    return 0


class TokenizerService:
    def __init__(self, engine_args: EngineArgs, stack: StackConfig, instance: str = "0"):
        self.stack = stack
        self.instance_id = process_instance_id()
        self.ctx = zmq.Context()
        self.status = "starting"
        self.handled = 0
        self.rejected = 0
        self.backlog = Backlog(_READ_AHEAD, RecentIds(_ABORTS_REMEMBERED_S, 65536))
        self.control = ControlServer(self.ctx, stack.control_for("tokenizer", instance),
                                     "tokenizer", self._health).start()
        config = engine_args.create_engine_config()
        mc = config.model_config
        try:
            chat_template = load_chat_template(stack.chat_template)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--chat-template: {e}") from None
        self.worker = RequestTokenizer(get_tokenizer(mc.tokenizer),
                                       PromptChecks(mc.max_model_len, mc.vocab_size), mc.hf_config,
                                       chat_template)
        self.input = make_socket(self.ctx, zmq.PULL)
        for addr in stack.replica_addresses("tokenizer_input"):  # any live front door feeds it
            connect(self.input, addr)
        self.engines = []  # one PUSH per engine replica
        for addr in stack.replica_addresses("engine_input"):
            sock = make_socket(self.ctx, zmq.PUSH)
            # Nothing is queued for an engine that is not there: a request tokenized meanwhile
            # is answered 503 at once, not run much later by an engine that nobody waits for.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            connect(sock, addr)
            self.engines.append(sock)
        self.routes = PushRoutes(self.ctx)
        self._stop = False
        self.status = "ok"

    def _health(self) -> tuple[str, dict]:
        return self.status, {"handled": self.handled, "rejected": self.rejected,
                             "dropped": self.backlog.num_dropped, "backlog": len(self.backlog),
                             "instance": self.instance_id}

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_stop", True))
        heartbeat_every = self.stack.liveness_timeout_s / 4
        last_beat = 0.0
        log.info("tokenizer ready", input=self.stack.tokenizer_input,
                 frozen_objects=freeze_startup_objects())
        try:
            while not self._stop:
                if time.monotonic() - last_beat > heartbeat_every:
                    beat = encode(Register("tokenizer", self.instance_id))
                    for replica in range(len(self.engines)):
                        self._send_to_engine(beat, replica)
                    last_beat = time.monotonic()
                if not self.backlog and not self.input.poll(
                        int(min(heartbeat_every, _STOP_CHECK_S) * 1000)):
                    continue
                self._read_ahead()  # before each request: aborts that came since drop theirs
                req = self.backlog.pop()
                if req is not None:
                    self._handle(req)
        finally:
            self.control.close()
            self.input.close(0)
            for sock in self.engines:
                sock.close(0)
            self.routes.close()
            self.ctx.term()

    def _read_ahead(self) -> None:
        """Move what the socket holds into the backlog, up to its size (beyond it, the socket's
        high-water mark pushes back as before)."""
        while not self.backlog.full:
            try:
                frame = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.backlog.add(decode(frame, (GenerateRequest, AbortRequest)))
            except CodecError as e:
                log.warning("dropped a bad frame", error=str(e), size=len(frame))
                self.rejected += 1

    def _handle(self, req: GenerateRequest) -> None:
        rlog = log.bind(request_id=req.request_id, replica=req.replica)
        if not 0 <= req.replica < len(self.engines):
            self.rejected += 1
            rlog.info("request rejected: no such engine replica")
            self.routes.send(req.gateway_id, encode(ErrorResponse(
                req.request_id, 400, f"replica: {req.replica} is not an engine replica of this "
                                     f"stack (0..{len(self.engines) - 1})")))
            return
        try:
            out = self.worker.tokenize(req)
        except RequestRejected as e:
            self.rejected += 1
            rlog.info("request rejected", error=str(e))
            self.routes.send(req.gateway_id, encode(ErrorResponse(req.request_id, e.code, str(e))))
            return
        except Exception as e:  # a tokenizer bug must not take the process down
            self.rejected += 1
            rlog.exception("tokenization failed")
            self.routes.send(req.gateway_id, encode(ErrorResponse(req.request_id, 500, str(e))))
            return
        if not self._send_to_engine(encode(out), req.replica):
            self.rejected += 1
            rlog.warning("the engine is not reachable")
            self.routes.send(req.gateway_id, encode(ErrorResponse(
                req.request_id, 503, "the engine is not reachable; retry later")))
            return
        self.handled += 1
        rlog.debug("tokenized", prompt_tokens=len(out.prompt_token_ids))

    def _send_to_engine(self, frame: bytes, replica: int) -> bool:
        try:
            self.engines[replica].send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
