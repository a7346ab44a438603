"""`pagoda engine`: the scheduler and step loop behind ZeroMQ (design §1, §3).

Sockets (all bound here; every other process connects):
- request_input (PULL) -> tokenizer_input (PUSH): the front door, a zmq proxy thread that
  spreads clients' GenerateRequests round robin over the tokenizers;
- engine_input (PULL): EngineRequest from tokenizers, AbortRequest from clients, FinishRequest
  from detokenizers, Register heartbeats from tokenizers and clients (gateways);
- worker_addr (ROUTER): the workers (ZmqExecutor);
- detokenizer_addr (ROUTER): detokenizers register; each request's TokenDeltas go to one of
  them, picked when the request first produces output and kept for its lifetime
  (`OutputDelivery`, output_delivery.py).

The loop keeps one step in flight: it schedules and submits step N+1 before reading step N.
While it waits for a step's output it keeps serving its other sockets, so requests are taken in
(and acknowledged) and heartbeats are read during long steps.

Faults it survives (`FaultRecovery`, fault_recovery.py; a lost detokenizer, `OutputDelivery`):
- a worker dies: `WorkerLost` (its heartbeats stop, or a send to it fails). The steps in flight
  are discarded and every request goes back to waiting to be recomputed from its tokens; once
  a worker registers for the rank again (the launcher restarts it) its KV cache is initialized
  and the step loop goes on. Tokens already sent downstream are never sent again.
- a detokenizer dies (a send to it fails, or its heartbeats stop): its requests move to another
  one, which gets each request's parameters and all its output tokens again; clients drop the
  text they already have by its offset.
- a tokenizer dies: clients resend what was not acknowledged (`RequestAccepted`); a copy of a
  request the engine already has (or has ended) is acknowledged again or ignored.
- a client (gateway) dies: its heartbeats stop, and its requests are aborted.
- a worker is stuck (a step in flight for `step_timeout_s`, heartbeats or not): as if it died;
  health says "stalled" while requests wait and no step completes.
- a worker's KV cache cannot be set up: tried `_MAX_SETUP_ATTEMPTS` times (fault_recovery.py),
  then health says "failed" with the error until a new worker process registers.
- this process dies: clients send their requests again, with their output so far, to the
  engine that replaces it (`LLMEngine.resume_outputs`), or to another replica.

With data parallelism this is one of several replicas (`StackConfig.replica`): it binds that
replica's entry of each address, its own front door included, so the tokenizers stay reachable
through the other replicas' front doors while it is away.
"""
import argparse
import signal
import threading
import time
from collections import OrderedDict, deque

import structlog
import zmq

from proto.codec import CodecError, decode, encode
from proto.control import Register
from proto.requests import (AbortRequest, EngineRequest, ErrorResponse, FinishRequest,
                            RequestAccepted)
from shared.engine_args import EngineArgs
from shared.gc_freeze import freeze_startup_objects
from shared.logging import configure, get_logger
from shared.recent_ids import RecentIds
from shared.sockets import ControlServer, PushRoutes, bind, make_socket, unlink_ipc
from shared.stack_config import StackConfig
from services.engine.executor.zmq_executor import WorkerLost, ZmqExecutor
from services.engine.fault_recovery import FaultRecovery
from services.engine.in_flight import may_submit, must_collect
from services.engine.output_delivery import OutputDelivery

log = get_logger("engine")

_ENDED_REMEMBERED = 65536  # ended requests whose late copies are recognised and ignored
# Aborts of requests not here yet (still at a tokenizer), and lost gateways: a request that
# arrives after either is dropped. Kept longer than a request waits in a tokenizer's queue.
_EARLY_ABORT_S = 120.0
_EARLY_ABORTS_REMEMBERED = 65536
_PEER_CHECK_S = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    configure("engine")
    stack = StackConfig.from_cli_args(args)
    structlog.contextvars.bind_contextvars(replica=stack.replica)  # on every line it logs
    EngineService(EngineArgs.from_cli_args(args), stack).serve()
    return 0


class EngineService(FaultRecovery):
    def __init__(self, engine_args: EngineArgs, stack: StackConfig):
        self.stack = stack
        self.ctx = zmq.Context()
        self.status = "starting"
        self.engine = None
        self.setup_error: str | None = None
        self.setup_failures: dict[tuple[str, ...], int] = {}  # by worker processes
        self.last_step_done = time.monotonic()  # or the engine's last idle moment
        self.peers: dict[str, dict[bytes | str, float]] = {
            "tokenizer": {}, "detokenizer": {}, "gateway": {}}
        self.control = ControlServer(self.ctx, stack.control_for("engine"), "engine",
                                     self._health).start()
        self._start_front_door()
        self.input = make_socket(self.ctx, zmq.PULL)
        bind(self.input, stack.engine_input)
        self.detok = make_socket(self.ctx, zmq.ROUTER)
        self.detok.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bind(self.detok, stack.detokenizer_addr)
        self.routes = PushRoutes(self.ctx)
        self.in_flight: deque = deque()  # SchedulerOutputs of submitted, uncollected steps
        self.step_bytes: deque[int] = deque(maxlen=64)
        # Acknowledgements to send, by client, gathered over one turn of the loop.
        self.acks: dict[str, list[str]] = {}
        # (request id, arrival time) of requests that ended: a late copy (a client resent it
        # while a slow tokenizer still had the first) is not run again.
        self.ended: OrderedDict[tuple[str, float], None] = OrderedDict()
        self.early_aborts = RecentIds(_EARLY_ABORT_S, _EARLY_ABORTS_REMEMBERED)
        self.lost_gateways = RecentIds(_EARLY_ABORT_S, 1024)
        self.dropped_on_arrival = 0  # requests whose client had left before they came
        self.worker_losses = 0
        self.gateway_losses = 0
        self._next_peer_check = 0.0
        self._stop = False
        config = engine_args.create_engine_config()
        self.executor = ZmqExecutor(config, stack, self.ctx)
        engine = self._build_engine(config)
        # Token deltas out to the detokenizers (it looks requests up in the engine, so after it).
        self.delivery = OutputDelivery(self.detok, self.routes, self.peers["detokenizer"],
                                       stack.liveness_timeout_s, engine, self._ended)
        self.engine = engine  # last: the health callback reads the fields above once it is set
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
        details = {"tokenizers": self._live("tokenizer"), "detokenizers": self._live("detokenizer"),
                   "replica": self.stack.replica}
        if self.setup_error is not None:
            details["error"] = self.setup_error
        if self.engine is not None:
            s = self.engine.get_stats()
            ready = self.executor.ready
            details.update(running=s.num_running, waiting=s.num_waiting, swapped=s.num_swapped,
                           kv_cache_usage=round(s.kv_cache_usage, 4),
                           device_blocks=self.engine.config.cache_config.num_device_blocks,
                           free_blocks=self.engine.scheduler.block_manager
                           .get_num_free_device_blocks(),
                           prefix_cache_hit_rate=round(s.prefix_cache_hit_rate, 4),
                           **self._prefix_cache_tokens(),
                           steps=s.num_steps, prompt_tokens=s.total_prompt_tokens,
                           generation_tokens=s.total_generation_tokens,
                           preemptions=sum(s.num_preemptions.values()),
                           workers=len(self.executor.workers) if ready else 0,
                           recovering=not ready, worker_losses=self.worker_losses,
                           detokenizer_losses=self.delivery.losses,
                           gateways=self._live("gateway"), gateway_losses=self.gateway_losses,
                           dropped_on_arrival=self.dropped_on_arrival,
                           last_step_bytes=self.step_bytes[-1] if self.step_bytes else 0,
                           **(s.spec_decode.health_details() if s.spec_decode else {}))
            stalled_s = self._stalled_s()
            if self.status == "ok" and stalled_s > self.stack.step_timeout_s:
                # Alive is not the same as making progress: say so to every probe.
                details["stalled_s"] = round(stalled_s, 1)
                return "stalled", details
        return self.status, details

    def _prefix_cache_tokens(self) -> dict[str, int]:
        """Prompt tokens looked up in the prefix cache since start, and those found (vLLM's
        prefix_cache_queries / prefix_cache_hits count tokens; the block manager, blocks)."""
        bm = self.engine.scheduler.block_manager
        size = self.engine.config.cache_config.block_size
        return {"prefix_cache_queries": bm.num_queried_blocks * size,
                "prefix_cache_hits": bm.num_hit_blocks * size}

    def _stalled_s(self) -> float:
        """How long requests have waited without any step completing (0 when none waits)."""
        if not self.engine.has_unfinished_requests():
            return 0.0
        return time.monotonic() - self.last_step_done

    def _live(self, service: str) -> int:
        now = time.monotonic()
        return sum(1 for t in list(self.peers[service].values())
                   if now - t < self.stack.liveness_timeout_s)

    # -- the loop ------------------------------------------------------------------------------
    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_stop", True))
        log.info("engine ready", requests=self.stack.request_input, workers=self.stack.worker_addr,
                 device_blocks=self.engine.config.cache_config.num_device_blocks,
                 frozen_objects=freeze_startup_objects())
        poller = zmq.Poller()
        for sock in (self.input, self.detok, self.executor.sock):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop:
                try:
                    timeout_ms = self._advance()
                    self._serve_sockets(poller, timeout_ms)
                except WorkerLost as e:
                    self._worker_lost(e)
        finally:
            self.close()

    def _advance(self) -> int:
        """One turn of the step loop; returns how long the next poll may wait (ms)."""
        if not self.in_flight and not self.engine.has_unfinished_requests():
            self.last_step_done = time.monotonic()  # idle is not stalled
        if not self.executor.ready:
            self._reinitialize_workers()
            if not self.executor.ready:
                return 200
        # 1) Schedule and submit the next step while the workers run the current one.
        submitted = False
        if may_submit(self.in_flight):
            request, sched = self.engine.schedule_step()
            if request is not None:
                self.executor.submit(request)
                self.step_bytes.append(self.executor.last_request_bytes)
                self.in_flight.append(sched)
                submitted = True
            elif sched.ignored_seq_groups:
                self.delivery.send_deltas(self.engine.process_ignored(sched), -1)
        # 2) Read the oldest step's output once it is here: tokens, stops, frees, deltas out.
        if must_collect(self.in_flight, submitted):
            result = self.executor.take_output()
            if result is None:
                return 250  # the poll returns as soon as it (or anything else) arrives
            sched = self.in_flight.popleft()
            self.last_step_done = time.monotonic()
            groups = self.engine.process_model_outputs(sched, result)
            self.delivery.send_deltas(groups, result.step_id)
            return 0
        return 0 if submitted else 200

    def _serve_sockets(self, poller: zmq.Poller, timeout_ms: int) -> None:
        ready = dict(poller.poll(timeout_ms))
        if self.input in ready:
            self._drain(self.input)
        if self.detok in ready:
            self._drain(self.detok)
        if self.executor.sock in ready:
            self.executor.receive()
        self._send_acks()
        now = time.monotonic()
        if now >= self._next_peer_check:
            self._next_peer_check = now + _PEER_CHECK_S
            self._check_peers(now)
        if self.delivery.undelivered:
            self.delivery.deliver_held()

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
            try:
                self._dispatch(msg, identity)
            except WorkerLost:
                raise
            except Exception:  # one message must never take the engine down
                log.exception("message handling failed", type=type(msg).__name__)

    def _dispatch(self, msg, identity: bytes | None) -> None:
        if isinstance(msg, EngineRequest):
            self._add_request(msg)
        elif isinstance(msg, (AbortRequest, FinishRequest)):
            # An abort's detokenizer holds the request's state until it sees the request end.
            ended = self._end_requests(msg.request_ids, msg.reason,
                                       tell_detokenizer=isinstance(msg, AbortRequest))
            if isinstance(msg, AbortRequest) and len(ended) < len(msg.request_ids):
                # Some are not here (yet): the abort overtook them at a tokenizer.
                found = {g.request_id for g in ended}
                self.early_aborts.add([r for r in msg.request_ids if r not in found])
        elif isinstance(msg, Register):
            key = identity if msg.service == "detokenizer" else msg.instance_id
            if msg.service in self.peers and key is not None:
                if key not in self.peers[msg.service]:
                    log.info("peer registered", service=msg.service, instance=msg.instance_id)
                    if msg.service == "gateway":
                        self.lost_gateways.discard(key)  # it was only late, not dead
                self.peers[msg.service][key] = time.monotonic()
        else:
            log.warning("unexpected message", type=type(msg).__name__)

    def _end_requests(self, request_ids: list[str], reason: str,
                      tell_detokenizer: bool) -> list:
        aborted = self.engine.abort_request(request_ids)
        if tell_detokenizer:
            told = [g for g in aborted if g.request_id in self.delivery.detok_of]
            self.delivery.send_deltas(told, -1)
        for group in aborted:
            self._ended(group)
            self.delivery.forget(group.request_id)
        if aborted:
            log.info("requests ended early", reason=reason,
                     request_ids=[g.request_id for g in aborted])
        return aborted

    def _add_request(self, req: EngineRequest) -> None:
        rlog = log.bind(request_id=req.request_id)
        if req.request_id in self.early_aborts or req.gateway_id in self.lost_gateways:
            # Its client left while it waited upstream: nobody reads its output.
            self.dropped_on_arrival += 1
            rlog.info("request dropped on arrival: its client had left")
            return
        if (req.request_id, req.arrival_time) in self.ended:
            rlog.info("a late copy of an ended request ignored")
            return
        known = self.engine.groups.get(req.request_id)
        if known is not None and known.metrics.arrival_time == req.arrival_time:
            self.acks.setdefault(req.gateway_id, []).append(req.request_id)  # a resent copy
            return
        try:
            group = self.engine.add_request(req.request_id, req.prompt, req.sampling_params,
                                            prompt_token_ids=req.prompt_token_ids,
                                            arrival_time=req.arrival_time,
                                            eos_token_ids=req.eos_token_ids,
                                            cache_salt=req.cache_salt)
            if req.resumed:
                try:
                    self.engine.resume_outputs(group, req.resumed)
                except ValueError:
                    self.engine.abort_request(req.request_id)
                    raise
                rlog.info("request resumed", resumed_tokens=sum(
                    len(r.token_ids) for r in req.resumed))
        except ValueError as e:
            rlog.warning("request refused", error=str(e))
            self.routes.send(req.gateway_id, encode(ErrorResponse(req.request_id, 400, str(e))))
            return
        group.return_prompt_token_ids = req.return_prompt_token_ids
        self.delivery.gateway_of[req.request_id] = req.gateway_id
        self.acks.setdefault(req.gateway_id, []).append(req.request_id)
        rlog.debug("request added", prompt_tokens=len(req.prompt_token_ids))

    def _send_acks(self) -> None:
        for gateway, request_ids in self.acks.items():
            self.routes.send(gateway, encode(RequestAccepted(request_ids)))
        self.acks.clear()

    def _ended(self, group) -> None:
        self.ended[(group.request_id, group.metrics.arrival_time)] = None
        if len(self.ended) > _ENDED_REMEMBERED:
            self.ended.popitem(last=False)

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
