"""`pagoda engine`: the scheduler and step loop behind ZeroMQ (design §1, §3).

Sockets (all bound here; every other process connects):
- request_input (PULL) -> tokenizer_input (PUSH): the front door, a zmq proxy thread that
  spreads clients' GenerateRequests round robin over the tokenizers;
- engine_input (PULL): EngineRequest from tokenizers, AbortRequest from clients, FinishRequest
  from detokenizers, Register heartbeats from tokenizers and clients (gateways);
- worker_addr (ROUTER): the workers (ZmqExecutor);
- detokenizer_addr (ROUTER): detokenizers register; each request's TokenDeltas go to one of
  them, picked when the request first produces output and kept for its lifetime.

The loop keeps one step in flight: it schedules and submits step N+1 before reading step N.
While it waits for a step's output it keeps serving its other sockets, so requests are taken in
(and acknowledged) and heartbeats are read during long steps.

Faults it survives:
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
- a worker's KV cache cannot be set up: tried `_MAX_SETUP_ATTEMPTS` times, then health says
  "failed" with the error until a new worker process registers.
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
import zlib
from collections import OrderedDict, deque

import structlog
import zmq

from proto.codec import CodecError, decode, encode
from proto.control import Register
from proto.requests import (AbortRequest, EngineRequest, ErrorResponse, FinishRequest,
                            PromptDelta, RequestAccepted, RequestTokenDelta, SequenceTokenDelta,
                            TokenDeltas)
from shared.config import EngineArgs
from shared.logging import configure, get_logger
from shared.recent_ids import RecentIds
from shared.sockets import ControlServer, PushRoutes, bind, make_socket, unlink_ipc
from shared.stack_config import StackConfig
from services.engine.executor.zmq_executor import WorkerCallError, WorkerLost, ZmqExecutor
from services.engine.llm_engine import LLMEngine, NoKVCacheError, may_submit, must_collect

log = get_logger("engine")

_DETOK_CONTEXT = 5  # prompt tokens the detokenizer decodes before the first output token
_ENDED_REMEMBERED = 65536  # ended requests whose late copies are recognised and ignored
# Aborts of requests not here yet (still at a tokenizer), and lost gateways: a request that
# arrives after either is dropped. Kept longer than a request waits in a tokenizer's queue.
_EARLY_ABORT_S = 120.0
_EARLY_ABORTS_REMEMBERED = 65536
_PEER_CHECK_S = 0.25
_MAX_SETUP_ATTEMPTS = 3  # KV cache set-ups that may fail for the same worker processes
_SETUP_RETRY_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    configure("engine")
    stack = StackConfig.from_cli_args(args)
    structlog.contextvars.bind_contextvars(replica=stack.replica)  # on every line it logs
    EngineService(EngineArgs.from_cli_args(args), stack).serve()
    return 0


class EngineService:
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
        self.gateway_of: dict[str, str] = {}  # request id -> the client's return address
        self.detok_of: dict[str, bytes] = {}  # request id -> its detokenizer (sticky)
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
        # Requests whose output waits for a live detokenizer (theirs died, none is left).
        self.undelivered: dict[str, object] = {}
        # Finished requests' last deltas, kept a while by detokenizer: if that one dies with
        # them unread, they are replayed to another. (monotonic time, detok, group, gateway)
        self.delivered: deque[tuple[float, bytes, object, str]] = deque()
        self.worker_losses = 0
        self.detokenizer_losses = 0
        self.gateway_losses = 0
        self._next_peer_check = 0.0
        self._stop = False
        config = engine_args.create_engine_config()
        self.executor = ZmqExecutor(config, stack, self.ctx)
        engine = self._build_engine(config)
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
                           detokenizer_losses=self.detokenizer_losses,
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
                 device_blocks=self.engine.config.cache_config.num_device_blocks)
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
                self._send_deltas(self.engine.process_ignored(sched), -1)
        # 2) Read the oldest step's output once it is here: tokens, stops, frees, deltas out.
        if must_collect(self.in_flight, submitted):
            result = self.executor.take_output()
            if result is None:
                return 250  # the poll returns as soon as it (or anything else) arrives
            sched = self.in_flight.popleft()
            self.last_step_done = time.monotonic()
            groups = self.engine.process_model_outputs(sched, result)
            self._send_deltas(groups, result.step_id)
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
        if self.undelivered:
            self._deliver_held()

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
            self._send_deltas([g for g in aborted if g.request_id in self.detok_of], -1)
        for group in aborted:
            self._ended(group)
            self.gateway_of.pop(group.request_id, None)
            self.detok_of.pop(group.request_id, None)
            self.undelivered.pop(group.request_id, None)
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
        self.gateway_of[req.request_id] = req.gateway_id
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

    # -- faults --------------------------------------------------------------------------------
    def _check_peers(self, now: float) -> None:
        if self.executor.has_all_workers():
            self.executor.check_liveness()
        timeout = self.stack.liveness_timeout_s
        while self.delivered and now - self.delivered[0][0] > 2 * timeout:
            self.delivered.popleft()
        stale = [d for d, seen in self.peers["detokenizer"].items() if now - seen > timeout]
        if stale:
            busy = set(self.detok_of.values()) | {entry[1] for entry in self.delivered}
            for detok in stale:
                if detok in busy:
                    self._detokenizer_lost(detok, f"no heartbeat for {timeout:.0f} s")
        for gateway in [g for g, seen in self.peers["gateway"].items() if now - seen > timeout]:
            self._gateway_lost(gateway, f"no heartbeat for {timeout:.0f} s")
        if self.executor.ready:
            self.executor.check_progress(self.stack.step_timeout_s)

    def _gateway_lost(self, gateway: str, reason: str) -> None:
        """A client process died: nobody reads its requests' output any more. They are
        aborted, which frees their blocks. (A client that never sent a heartbeat is never
        taken for dead.)"""
        del self.peers["gateway"][gateway]
        self.lost_gateways.add(gateway)  # its requests still upstream are dropped as they come
        self.gateway_losses += 1
        request_ids = [r for r, g in self.gateway_of.items() if g == gateway]
        log.warning("gateway lost; aborting its requests", gateway=gateway, reason=reason,
                    requests=len(request_ids))
        if request_ids:
            self._end_requests(request_ids, "gateway lost", tell_detokenizer=True)

    def _worker_lost(self, error: WorkerLost) -> None:
        ranks = self.executor.drop_lost_workers()
        self.in_flight.clear()
        num_requests = self.engine.recover_from_worker_loss()
        self.worker_losses += 1
        log.error("worker lost; its requests will be recomputed on its replacement",
                  error=str(error), ranks=ranks, requests=num_requests)

    def _build_engine(self, config):
        """The LLMEngine, once the workers' KV cache is set up. A setup that fails is tried
        again, `_MAX_SETUP_ATTEMPTS` times for the same worker processes; then they are
        ignored (health says why) until new ones register."""
        while True:
            self.executor.wait_for_workers(float("inf"))
            try:
                engine = LLMEngine(config, lambda _: self.executor, detokenize=False)
            except WorkerLost as e:
                log.error("a worker was lost while the KV cache was set up", error=str(e))
                self.executor.drop_lost_workers()
                continue
            except (WorkerCallError, NoKVCacheError) as e:
                self._setup_failed(e)
                continue
            self._setup_ok()
            return engine

    def _setup_failed(self, error: Exception) -> None:
        instances = self.executor.worker_instances()
        attempt = self.setup_failures[instances] = self.setup_failures.get(instances, 0) + 1
        log.error("worker setup failed", error=str(error), attempt=attempt,
                  max_attempts=_MAX_SETUP_ATTEMPTS, workers=list(instances))
        if attempt < _MAX_SETUP_ATTEMPTS:
            time.sleep(_SETUP_RETRY_S)
            return
        self.executor.refuse_workers()
        self.status = "failed"
        self.setup_error = (f"{error} (failed {attempt} times; these worker processes are "
                            f"ignored until new ones register)")
        log.error("giving up on these worker processes; waiting for new ones",
                  workers=list(instances), error=str(error))

    def _setup_ok(self) -> None:
        self.setup_error = None
        self.setup_failures.clear()
        if self.status == "failed":
            self.status = "ok"

    def _reinitialize_workers(self) -> None:
        """Once every rank has a worker again: size and initialize the new KV cache."""
        if not self.executor.has_all_workers():
            return
        try:
            num_device_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
            if num_device_blocks <= 0:
                raise NoKVCacheError("the new worker has no memory for a KV cache")
            self.executor.initialize_cache(num_device_blocks, num_cpu_blocks)
        except (WorkerCallError, NoKVCacheError) as e:
            self._setup_failed(e)
            if self.executor.has_all_workers():
                raise WorkerLost(str(e)) from None  # dropped, to register and try again
            return  # refused: a new worker process must come
        self._setup_ok()
        self.engine.resize_cache(num_device_blocks, num_cpu_blocks)
        log.info("workers back; resuming", device_blocks=num_device_blocks,
                 waiting=len(self.engine.scheduler.waiting))

    def _detokenizer_lost(self, detok: bytes, reason: str) -> None:
        """Its requests start over on another detokenizer: parameters and every output token
        again (clients drop the text they already have by its offset)."""
        self.peers["detokenizer"].pop(detok, None)
        self.detokenizer_losses += 1
        moved = []
        for request_id, d in list(self.detok_of.items()):
            if d == detok:
                del self.detok_of[request_id]
                group = self.engine.groups.get(request_id)
                if group is not None and request_id in self.gateway_of:
                    moved.append(group)
        kept: deque = deque()
        for entry in self.delivered:
            if entry[1] == detok:
                self.gateway_of[entry[2].request_id] = entry[3]
                moved.append(entry[2])
            else:
                kept.append(entry)
        self.delivered = kept
        for group in moved:
            group.header_sent = False
            for seq in group.seqs:
                seq.num_emitted = 0
            self.undelivered[group.request_id] = group
        log.warning("detokenizer lost; its requests move to another", reason=reason,
                    requests=len(moved))

    def _deliver_held(self) -> None:
        if self._any_detokenizer():
            groups = list(self.undelivered.values())
            self.undelivered.clear()
            self._send_deltas(groups, -1)

    def _any_detokenizer(self) -> bool:
        return bool(self.peers["detokenizer"])

    # -- outputs -------------------------------------------------------------------------------
    def _send_deltas(self, groups, step_id: int) -> None:
        by_detok: dict[bytes, list[RequestTokenDelta]] = {}
        now = time.monotonic()
        for group in groups:
            request_id = group.request_id
            gateway = self.gateway_of.get(request_id)
            if gateway is None:
                continue
            if group.is_finished():
                self._ended(group)
            if group.error is not None:
                self.routes.send(gateway, encode(ErrorResponse(request_id, 400, group.error)))
                self.gateway_of.pop(request_id, None)
                continue
            detok = self._detokenizer_for(request_id)
            if detok is None:
                self.undelivered[request_id] = group  # sent once a detokenizer is back
                continue
            self.undelivered.pop(request_id, None)
            by_detok.setdefault(detok, []).append(self._token_delta(group, gateway))
            if group.is_finished():
                self.gateway_of.pop(request_id, None)
                self.detok_of.pop(request_id, None)
                self.delivered.append((now, detok, group, gateway))
        for detok, deltas in by_detok.items():
            try:
                self.detok.send_multipart([detok, encode(TokenDeltas(step_id, deltas))])
            except zmq.ZMQError as e:
                self._detokenizer_lost(detok, f"unreachable: {e}")

    def _token_delta(self, group, gateway: str) -> RequestTokenDelta:
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
        if not first:
            return RequestTokenDelta(group.request_id, gateway, group.prompt_len, seqs)
        return RequestTokenDelta(
            group.request_id, gateway, group.prompt_len, seqs, sampling_params=params,
            prompt_tail_token_ids=group.prompt_token_ids[-_DETOK_CONTEXT:],
            prompt=_prompt_delta(group), queue_time_s=group.metrics.time_in_queue,
            num_cached_tokens=group.num_cached_tokens)

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


def _prompt_delta(group) -> PromptDelta | None:
    """The prompt's token ids and logprobs for a request's header, when it asked for them."""
    if not group.return_prompt_token_ids and group.prompt_logprobs is None:
        return None
    prompt = group.prompt_token_ids
    delta = PromptDelta(list(prompt))
    for pos, entry in enumerate(group.prompt_logprobs or []):
        if entry is not None:  # position 0 has none
            delta.logprobs.append(entry[prompt[pos]])
            delta.top_token_ids.append(list(entry))
            delta.top_logprobs.append(list(entry.values()))
    return delta
