"""`pagoda engine`: the scheduler and step loop behind ZeroMQ (design §1, §3).

Sockets (all bound here; every other process connects):
- request_input (PULL) -> tokenizer_input (PUSH): the front door, a zmq proxy thread that
  spreads clients' GenerateRequests round robin over the tokenizers;
- engine_input (PULL): EngineRequest from tokenizers, AbortRequest from clients, FinishRequest
  from detokenizers, Register heartbeats from tokenizers;
- worker_addr (ROUTER): the workers (ZmqExecutor);
- detokenizer_addr (ROUTER): detokenizers register; each request's TokenDeltas go to one of
  them, picked when the request first produces output and kept for its lifetime.

The loop keeps one step in flight: it schedules and submits step N+1 before reading step N.
"""
import argparse
import signal
import threading
import time
import zlib
from collections import deque

import zmq

from proto.codec import CodecError, decode, encode
from proto.control import Register
from proto.requests import (AbortRequest, EngineRequest, ErrorResponse, FinishRequest,
                            RequestTokenDelta, SequenceTokenDelta, TokenDeltas)
from shared.config import EngineArgs
from shared.logging import configure, get_logger
from shared.sockets import ControlServer, PushRoutes, bind, make_socket, unlink_ipc
from shared.stack_config import StackConfig

log = get_logger("engine")

_DETOK_CONTEXT = 5  # prompt tokens the detokenizer decodes before the first output token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    configure("engine")
    EngineService(EngineArgs.from_cli_args(args), StackConfig.from_cli_args(args)).serve()
    return 0


class EngineService:
    def __init__(self, engine_args: EngineArgs, stack: StackConfig):
        from services.engine.executor.zmq_executor import ZmqExecutor
        from services.engine.llm_engine import LLMEngine
        self.stack = stack
        self.ctx = zmq.Context()
        self.status = "starting"
        self.engine = None
        self.peers: dict[str, dict[bytes | str, float]] = {"tokenizer": {}, "detokenizer": {}}
        self.control = ControlServer(self.ctx, stack.control_for("engine"), "engine",
                                     self._health).start()
        self._start_front_door()
        self.input = make_socket(self.ctx, zmq.PULL)
        bind(self.input, stack.engine_input)
        self.detok = make_socket(self.ctx, zmq.ROUTER)
        self.detok.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bind(self.detok, stack.detokenizer_addr)
        self.routes = PushRoutes(self.ctx)
        config = engine_args.create_engine_config()
        self.executor_factory = lambda cfg: ZmqExecutor(cfg, stack, self.ctx)
        self.engine = LLMEngine(config, self.executor_factory, detokenize=False)
        self.executor = self.engine.executor
        self.gateway_of: dict[str, str] = {}  # request id -> the client's return address
        self.detok_of: dict[str, bytes] = {}  # request id -> its detokenizer (sticky)
        self.in_flight: deque = deque()  # SchedulerOutputs of submitted, uncollected steps
        self.step_bytes: deque[int] = deque(maxlen=64)
        self._stop = False
        self.status = "ok"

    # -- sockets -------------------------------------------------------------------------------
    def _start_front_door(self) -> None:
        front = make_socket(self.ctx, zmq.PULL)
        bind(front, self.stack.request_input)
        back = make_socket(self.ctx, zmq.PUSH)
        bind(back, self.stack.tokenizer_input)
        self._front = (front, back)

        def proxy():
            try:
                zmq.proxy(front, back)  # runs in C, outside the GIL
            except zmq.ZMQError:
                pass  # context terminated at shutdown
        threading.Thread(target=proxy, name="front-door", daemon=True).start()

    def _health(self) -> tuple[str, dict]:
        details = {"tokenizers": self._live("tokenizer"), "detokenizers": self._live("detokenizer")}
        if self.engine is not None:
            s = self.engine.get_stats()
            details.update(running=s.num_running, waiting=s.num_waiting, swapped=s.num_swapped,
                           kv_cache_usage=round(s.kv_cache_usage, 4),
                           prefix_cache_hit_rate=round(s.prefix_cache_hit_rate, 4),
                           steps=s.num_steps, prompt_tokens=s.total_prompt_tokens,
                           generation_tokens=s.total_generation_tokens,
                           preemptions=sum(s.num_preemptions.values()),
                           workers=len(self.engine.executor.workers),
                           last_step_bytes=self.step_bytes[-1] if self.step_bytes else 0)
        return self.status, details

    def _live(self, service: str) -> int:
        now = time.monotonic()
        return sum(1 for t in self.peers[service].values()
                   if now - t < self.stack.liveness_timeout_s)

    # -- the loop ------------------------------------------------------------------------------
    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_stop", True))
        log.info("engine ready", requests=self.stack.request_input, workers=self.stack.worker_addr,
                 device_blocks=self.engine.config.cache_config.num_device_blocks)
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        poller.register(self.detok, zmq.POLLIN)
        try:
            while not self._stop:
                idle = not self.in_flight and not self.engine.has_unfinished_requests()
                # 1) Take in what arrived (block only when there is nothing else to do).
                for sock, _ in poller.poll(200 if idle else 0):
                    self._drain(sock)
                # 2) Schedule and submit the next step while the workers run the current one.
                request = None
                if len(self.in_flight) < 2:
                    request, sched = self.engine.schedule_step()
                    if request is not None:
                        self.executor.submit(request)
                        self.step_bytes.append(self.executor.last_request_bytes)
                        self.in_flight.append(sched)
                    elif sched.ignored_seq_groups:
                        self._send_deltas(self.engine.process_ignored(sched), -1)
                # 3) Read the oldest step's output: tokens, stops, frees, deltas out.
                if self.in_flight and (len(self.in_flight) == 2 or request is None):
                    sched = self.in_flight.popleft()
                    result = self.executor.collect()
                    groups = self.engine.process_model_outputs(sched, result)
                    self._send_deltas(groups, result.step_id)
        finally:
            self.close()

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.detok:
                identity, frame = frames[0], frames[-1]
            else:
                identity, frame = None, frames[-1]
            try:
                msg = decode(frame)
            except CodecError as e:
                log.warning("dropped a bad frame", error=str(e), size=len(frame))
                continue
            self._dispatch(msg, identity)

    def _dispatch(self, msg, identity: bytes | None) -> None:
        if isinstance(msg, EngineRequest):
            self._add_request(msg)
        elif isinstance(msg, (AbortRequest, FinishRequest)):
            aborted = self.engine.abort_request(msg.request_ids)
            for group in aborted:
                self.gateway_of.pop(group.request_id, None)
                self.detok_of.pop(group.request_id, None)
            if aborted:
                log.info("requests ended early", reason=msg.reason,
                         request_ids=[g.request_id for g in aborted])
        elif isinstance(msg, Register):
            key = identity if msg.service == "detokenizer" else msg.instance_id
            if msg.service in self.peers:
                if key not in self.peers[msg.service]:
                    log.info("peer registered", service=msg.service, instance=msg.instance_id)
                self.peers[msg.service][key] = time.monotonic()
        else:
            log.warning("unexpected message", type=type(msg).__name__)

    def _add_request(self, req: EngineRequest) -> None:
        rlog = log.bind(request_id=req.request_id)
        try:
            self.engine.add_request(req.request_id, req.prompt, req.sampling_params,
                                    prompt_token_ids=req.prompt_token_ids,
                                    arrival_time=req.arrival_time,
                                    eos_token_ids=req.eos_token_ids)
        except ValueError as e:
            rlog.warning("request refused", error=str(e))
            self.routes.send(req.gateway_id, encode(ErrorResponse(req.request_id, 400, str(e))))
            return
        self.gateway_of[req.request_id] = req.gateway_id
        rlog.debug("request added", prompt_tokens=len(req.prompt_token_ids))

    # -- outputs -------------------------------------------------------------------------------
    def _send_deltas(self, groups, step_id: int) -> None:
        by_detok: dict[bytes, list[RequestTokenDelta]] = {}
        for group in groups:
            gateway = self.gateway_of.get(group.request_id)
            if gateway is None:
                continue
            if group.error is not None:
                self.routes.send(gateway, encode(ErrorResponse(group.request_id, 400, group.error)))
                self.gateway_of.pop(group.request_id, None)
                continue
            delta, first = self._token_delta(group, gateway)
            detok = self._detokenizer_for(group.request_id)
            if detok is None:
                self.routes.send(gateway, encode(ErrorResponse(
                    group.request_id, 503, "no detokenizer is running")))
                continue
            by_detok.setdefault(detok, []).append(delta)
            if group.is_finished():
                self.gateway_of.pop(group.request_id, None)
                self.detok_of.pop(group.request_id, None)
        for detok, deltas in by_detok.items():
            try:
                self.detok.send_multipart([detok, encode(TokenDeltas(step_id, deltas))])
            except zmq.ZMQError as e:
                log.error("detokenizer unreachable", error=str(e))
                self.peers["detokenizer"].pop(detok, None)

    def _token_delta(self, group, gateway: str) -> tuple[RequestTokenDelta, bool]:
        first = not group.header_sent
        params = group.sampling_params
        seqs = []
        for seq in group.seqs:
            end = seq.num_known_tokens
            start = seq.prompt_len + seq.num_emitted
            new = seq.token_ids[start:end]
            if not new and not seq.is_finished():
                continue
            delta = SequenceTokenDelta(seq.sample_index, new, num_output_tokens=end - seq.prompt_len,
                                       finish_reason=seq.status.finish_reason,
                                       stop_reason=seq.stop_reason)
            if params.logprobs is not None:
                lps = seq.output_logprobs[seq.num_emitted:seq.num_emitted + len(new)]
                delta.logprobs = [d[t] for d, t in zip(lps, new)]
                delta.top_token_ids = [list(d) for d in lps]
                delta.top_logprobs = [list(d.values()) for d in lps]
            seq.num_emitted += len(new)
            seqs.append(delta)
        group.header_sent = True
        delta = RequestTokenDelta(
            group.request_id, gateway, group.prompt_len, seqs,
            sampling_params=params if first else None,
            prompt_tail_token_ids=group.prompt_token_ids[-_DETOK_CONTEXT:] if first else [])
        return delta, first

    def _detokenizer_for(self, request_id: str) -> bytes | None:
        detok = self.detok_of.get(request_id)
        if detok is not None:
            return detok
        # Prefer those that beat recently; a slow one (a loaded machine) is still better than
        # none. A dead one is dropped when a send to it fails (ROUTER_MANDATORY).
        now = time.monotonic()
        known = self.peers["detokenizer"]
        live = sorted(k for k, t in known.items() if now - t < self.stack.liveness_timeout_s)
        candidates = live or sorted(known)
        if not candidates:
            return None
        detok = candidates[zlib.crc32(request_id.encode()) % len(candidates)]
        self.detok_of[request_id] = detok
        return detok

    def close(self) -> None:
        log.info("engine stopping")
        self.control.close()
        try:
            self.executor.shutdown()
        except Exception:
            pass
        self.routes.close()
        self.ctx.destroy(linger=0)
        unlink_ipc(self.stack.request_input, self.stack.tokenizer_input, self.stack.engine_input,
                   self.stack.worker_addr, self.stack.detokenizer_addr)
