"""AsyncEngineClient: submit requests to a pagoda stack over ZeroMQ and stream the outputs.

Any Python service can use it; the HTTP gateway is one. It pushes GenerateRequests to the
engine's front door (tokenizers pick them up), binds its own return address (its gateway id)
where detokenizers push the text, heartbeats to the engine (which aborts this client's requests
when the heartbeats stop: the process died), and aborts requests whose consumer goes away.

Faults it rides out or reports:
- a request that is not acknowledged (`RequestAccepted`, or any output or error of it) within
  `ack_timeout_s` is sent again with the same id (a tokenizer died with it); the engine ignores
  copies. After `max_resubmits` resends it fails with 503.
- text that a detokenizer sends again (it took over a request from one that died) is dropped
  by its offset, so a stream never repeats itself.
- the engine's control socket is probed every `probe_interval_s` (`EngineWatch`,
  engine_watch.py). When it answers from another process (it restarted), every request in
  flight is sent again with the output its caller already has (`ResumedOutput`): the new
  engine recomputes those tokens and samples on, and its text, decoded again from the start,
  is cut where the caller's stream stands. Requests without a seed get one here (drawn at
  random: the engine's `--seed` no longer decides it), so a sampled request also goes on as
  it would have. While the engine is away new requests wait for it; only once it has been
  away for `output_timeout_s` do the requests in flight end with 503 and new ones get 503 at
  once.

With several engine replicas (data parallelism) each request is bound to one, the least loaded
by the replicas' own health reports (`replicas.least_loaded`), and stays there: its frame names
the replica, and the tokenizers push it to that replica's input. Each replica is probed as
above; the requests of one that stops answering "ok" move, with their output so far, to a live
one (as to a restarted engine), and are resent to a restarted one only if none other was live.
"""
import asyncio
import contextlib
import contextvars
import dataclasses
import os
import random
import time
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from proto.codec import CodecError, decode, encode
from proto.requests import (AbortRequest, ChatMessage, ChatPrompt, ErrorResponse,
                            GenerateRequest, PromptOptions, RequestAccepted, TextDeltas)
from shared.logging import get_logger
from shared.sampling_params import SamplingParams
from shared.sockets import bind, bind_random_port, connect, make_socket, unlink_ipc
from shared.stack_config import StackConfig
from services.gateway.heartbeat import GatewayHeartbeat
from services.gateway.engine_watch import EngineWatch
from services.gateway.request_stream import (ACCEPTED, RESUBMIT, TIMED_OUT, EngineRequestError,
                                             RequestStream, request_output)
from shared.outputs import RequestOutput

log = get_logger("client")


class AsyncEngineClient:
    def __init__(self, stack: StackConfig | None = None, output_timeout_s: float = 60.0,
                 ack_timeout_s: float = 5.0, max_resubmits: int = 3,
                 engine_timeout_s: float | None = None, probe_interval_s: float = 1.0):
        """`output_timeout_s`: a request with no output for this long ends with an error
        (503), unless its engine ran steps in that time and was not seen holding no requests
        since the request's last output (it waits its turn behind others); and every request
        ends so once the engine has been away this long.
        `ack_timeout_s`, `max_resubmits`: how long to wait for the engine to acknowledge a
        request before sending it again, and how often. `engine_timeout_s` (default: the
        stack's liveness timeout): how long the engine may leave its control socket
        unanswered before it counts as away."""
        self.stack = stack or StackConfig()
        self.ack_timeout_s = ack_timeout_s
        self.max_resubmits = max_resubmits
        self.probe_interval_s = probe_interval_s
        self.curve = self.stack.curve  # None: CURVE off, or this process's keys (shared.curve)
        self.ctx = zmq.asyncio.Context()
        # IMMEDIATE: while the engine is down nothing queues up to reach it much later.
        # Every replica's front door reaches the same tokenizers: any live one will do.
        self.requests = make_socket(self.ctx, zmq.PUSH)
        self.requests.setsockopt(zmq.IMMEDIATE, 1)
        for addr in self.stack.replica_addresses("request_input"):
            connect(self.requests, addr, self.curve)
        self.engines = []  # each replica's input, for aborts
        for addr in self.stack.replica_addresses("engine_input"):
            sock = make_socket(self.ctx, zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            connect(sock, addr, self.curve)
            self.engines.append(sock)
        self.results = make_socket(self.ctx, zmq.PULL)
        if self.stack.request_input.startswith("tcp://"):
            self.gateway_id = bind_random_port(self.results, self.stack.return_host, self.curve)
        else:
            self.gateway_id = f"ipc://{os.path.join(self.stack.run_dir, f'client-{uuid.uuid4().hex[:12]}.sock')}"
            bind(self.results, self.gateway_id, self.curve)
        self.streams: dict[str, RequestStream] = {}
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self.closed = False
        self._heartbeat = GatewayHeartbeat(self.stack, self.gateway_id, self.curve)
        self.watch = EngineWatch(self.stack, self.streams, output_timeout_s,
                                 self.stack.liveness_timeout_s if engine_timeout_s is None
                                 else engine_timeout_s)
        self.num_resubmits = 0  # requests sent again for want of an acknowledgement
        self.num_resumed = 0  # requests sent again, with their output, to a new engine
        self.num_resumed_tokens = 0  # the output tokens they carried

    # -- public API ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start watching the engine now (a server calls this at start-up), rather than at the
        first request, so that the time the engine has been away is known from the start."""
        self._ensure_tasks()

    @property
    def output_timeout_s(self) -> float:
        """How long a request may go without output (see `__init__`); the watch gives up on an
        engine away this long."""
        return self.watch.output_timeout_s

    @output_timeout_s.setter
    def output_timeout_s(self, seconds: float) -> None:
        self.watch.output_timeout_s = seconds

    @property
    def engine_timeout_s(self) -> float:
        """How long the engine may leave its control socket unanswered before it counts as
        away (the watch's, like `output_timeout_s`)."""
        return self.watch.engine_timeout_s

    @engine_timeout_s.setter
    def engine_timeout_s(self, seconds: float) -> None:
        self.watch.engine_timeout_s = seconds

    @property
    def engine_ok(self) -> bool:
        """Some engine replica answers "ok" (`EngineWatch.ok`)."""
        return self.watch.ok

    @property
    def engine_given_up(self) -> bool:
        """The engine has been away for longer than a request may wait for it."""
        return self.watch.given_up

    async def generate(self, prompt: str | list[int] | list[dict] | list[ChatMessage],
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       cache_salt: str | None = None,
                       prompt_options: PromptOptions | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs whose completions hold the *new* text and tokens of each step;
        the last one has `finished=True`. Leaving the loop early aborts the request. The first
        output carries the prompt's token ids when `prompt_options` asks for them, and its
        logprobs when the sampling parameters do."""
        self._ensure_tasks()
        params = sampling_params or SamplingParams()
        if params.seed is None:
            # Drawn here rather than in the engine: a request resumed on a new engine then
            # draws the tokens it would have drawn on the old one.
            params = dataclasses.replace(params, seed=random.getrandbits(31))
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if not self.watch.probed:
            await self.watch.probe()  # the first request: know whether the engine is there at all
        if self.engine_given_up:
            raise EngineRequestError(
                503, f"the engine has not been available for {self.watch.away_s():.0f} s; "
                     f"retry later", request_id)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = [ChatMessage(m["role"], m["content"]) for m in prompt]
        stream = RequestStream(asyncio.Queue(), 0, prompt, params, time.time(),
                         cache_salt, prompt_options)
        self.streams[request_id] = stream
        finished = False
        accepted = False  # by the engine; until then the request may wait at a tokenizer
        try:
            try:
                frame = self._frame(request_id, stream)
            except CodecError as e:  # e.g. a number too large for the wire
                finished = True
                raise EngineRequestError(400, f"the request cannot be encoded: {e}",
                                         request_id) from None
            await self.watch.wait(request_id)
            self.watch.bind(request_id, stream)
            if stream.replica:
                frame = self._frame(request_id, stream)
            await self._submit(frame, request_id)
            accepted, resends = False, 0
            unreachable_since = None  # when a tokenizer first said it cannot reach the engine
            quiet_since = time.monotonic()  # the request's last sign of life
            wait_s = None  # set when a quiet request was found waiting its turn
            while True:
                timeout = wait_s or (self.output_timeout_s if accepted
                                     else min(self.ack_timeout_s, self.output_timeout_s))
                wait_s = None
                # Not `wait_for`: on Python 3.11 it can swallow a cancellation that comes as
                # the item does, and a request whose client left then runs on.
                item = await stream.next_item(timeout)
                if item is TIMED_OUT:
                    if not self.watch.replicas[stream.replica].ok and not self.engine_given_up:
                        continue  # the watchdog resubmits it or, in the end, fails it
                    if self.engine_given_up:
                        raise EngineRequestError(
                            503, f"the engine has not been available for "
                                 f"{self.watch.away_s():.0f} s", request_id) from None
                    if accepted:
                        replica = self.watch.replicas[stream.replica]
                        now = time.monotonic()
                        if replica.waiting_its_turn(now - self.output_timeout_s, quiet_since):
                            # Behind other requests of a busy engine: it waits, until the
                            # engine has gone a whole timeout without a step.
                            wait_s = max(replica.stepped_after + self.output_timeout_s - now,
                                         self.probe_interval_s)
                            continue
                        why = (" (the engine holds no requests)"
                               if replica.idle_at >= quiet_since else "")
                        raise EngineRequestError(
                            503, f"no output from the engine for {now - quiet_since:.0f} "
                                 f"s{why}", request_id) from None
                    if resends >= self.max_resubmits:
                        raise EngineRequestError(
                            503, f"the stack did not accept the request (sent {resends + 1} "
                                 f"times, {self.ack_timeout_s:g} s apart); retry later",
                            request_id) from None
                    resends += 1
                    self.num_resubmits += 1
                    log.warning("request not acknowledged; sending it again",
                                request_id=request_id, attempt=resends + 1)
                    await self._submit(frame, request_id)
                    continue
                quiet_since = time.monotonic()
                if item is RESUBMIT:
                    frame = self._frame(request_id, stream)
                    accepted, resends = False, 0
                    num_tokens = sum(map(len, stream.token_ids.values()))
                    self.num_resumed += 1 if num_tokens else 0
                    self.num_resumed_tokens += num_tokens
                    log.info("request sent to the new engine", request_id=request_id,
                             replica=stream.replica, resumed_tokens=num_tokens)
                    await self._submit(frame, request_id)
                    continue
                accepted = True
                if item is ACCEPTED:
                    unreachable_since = None
                    continue
                if isinstance(item, EngineRequestError):
                    raise item
                if isinstance(item, ErrorResponse):
                    if item.code == 503:
                        # A tokenizer could not reach the engine (it died, maybe before the
                        # watchdog saw it): again, until the engine has been away too long.
                        now = time.monotonic()
                        unreachable_since = unreachable_since or now
                        if now - unreachable_since < self.output_timeout_s:
                            accepted = False
                            await asyncio.sleep(self.probe_interval_s)
                            await self.watch.wait(request_id)
                            if not self.watch.replicas[stream.replica].ok:
                                self.watch.bind(request_id, stream)  # away: another one
                            frame = self._frame(request_id, stream)
                            await self._submit(frame, request_id)
                            continue
                    finished = True  # the stack already dropped it
                    raise EngineRequestError(item.code, item.message, request_id)
                out = request_output(item, stream, params.n)
                if out is None:
                    continue  # all of it was text the caller already has
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            stream.stop_timer()
            self.streams.pop(request_id, None)
            if not finished and not self.closed:
                with contextlib.suppress(Exception):
                    await self.abort(request_id, upstream=not accepted, replica=stream.replica)

    async def abort(self, request_id: str | list[str], reason: str = "client gone",
                    upstream: bool = True, replica: int | None = None) -> None:
        """Tell the engine to drop these requests. The engine remembers an abort that
        overtook its request, and drops the request when it comes. `upstream`: send it to
        the tokenizers' queue too, where one that still holds the request drops it untokenized
        (pointless once the engine has acknowledged it). `replica`: the engine replica that
        has them (None: every one)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        frame = encode(AbortRequest(ids, reason))
        # Best effort: an engine that is down has nothing to abort.
        engines = self.engines if replica is None else [self.engines[replica]]
        for engine in engines:
            await self._send_within(engine, frame, 0.5)
        if upstream:
            await self._send_within(self.requests, frame, 0.1)

    async def health(self, timeout_s: float = 1.0):
        """The engine's HealthResponse (with its counts of live peers), or None if it is down;
        with several replicas, their answers combined (`replicas.combined_health`)."""
        return await self.watch.health(timeout_s)

    def close(self) -> None:
        self.closed = True
        self._heartbeat.stop()
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        for sock in (self.requests, self.results, *self.engines):
            sock.close(0)
        self.ctx.term()
        unlink_ipc(self.gateway_id)

    # -- internals -----------------------------------------------------------------------------
    def _ensure_tasks(self) -> None:
        # In a context of their own: not in that of the request that happened to start them
        # (whose log bindings they would otherwise carry).
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read_results(), context=contextvars.Context())
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = loop.create_task(self.watch.run(lambda: self.probe_interval_s),
                                              context=contextvars.Context())
        self._heartbeat.start()

    def _frame(self, request_id: str, stream: RequestStream) -> bytes:
        prompt, chat_options = stream.prompt, None
        if isinstance(prompt, ChatPrompt):  # a chat with rendering options (tools, template)
            prompt, chat_options = prompt.messages, prompt.options
        return encode(GenerateRequest(request_id, self.gateway_id, prompt, stream.params,
                                      stream.arrival_time, stream.cache_salt, stream.resumed(),
                                      chat_options, stream.prompt_options, stream.replica))

    async def _submit(self, frame: bytes, request_id: str) -> None:
        """Send to the engine's front door. Connecting takes a moment after start, and the
        engine may be restarting: keep trying while it may come back."""
        # Past this, an engine still taken for ok has had time to be found missing: its front
        # door is refusing for another reason.
        deadline = time.monotonic() + self.engine_timeout_s + 5.0
        while not await self._send_within(self.requests, frame, 1.0):
            if self.engine_given_up or (self.engine_ok and time.monotonic() > deadline):
                raise EngineRequestError(503, "the engine is not reachable; retry later",
                                         request_id)
            await self.watch.wait(request_id)

    @staticmethod
    async def _send_within(sock: zmq.asyncio.Socket, frame: bytes, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # Not `sock.poll(POLLOUT)`: with pyzmq's asyncio sockets that leaves later
                # sends queued behind a writability that never comes while the peer is away.
                await asyncio.sleep(min(left, 0.02))

    async def _read_results(self) -> None:
        while True:
            frame = await self.results.recv()
            try:
                msg = decode(frame, (TextDeltas, ErrorResponse, RequestAccepted))
            except CodecError as e:
                log.warning("dropped a bad frame", error=str(e))
                continue
            if isinstance(msg, ErrorResponse):
                stream = self.streams.get(msg.request_id)
                if stream is not None:
                    stream.queue.put_nowait(msg)
            elif isinstance(msg, RequestAccepted):
                for request_id in msg.request_ids:
                    stream = self.streams.get(request_id)
                    if stream is not None:
                        stream.queue.put_nowait(ACCEPTED)
            else:
                for delta in msg.requests:
                    stream = self.streams.get(delta.request_id)
                    if stream is not None:
                        stream.queue.put_nowait(delta)
