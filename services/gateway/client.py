"""AsyncEngineClient: submit requests to a pagoda stack over ZeroMQ and stream the outputs.

Any Python service can use it; the HTTP gateway is one. It pushes GenerateRequests to the
engine's front door (tokenizers pick them up), binds its own return address (its gateway id)
where detokenizers push the text, and aborts requests whose consumer goes away.
"""
import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from proto.codec import CodecError, decode, encode
from proto.requests import (AbortRequest, ChatMessage, ErrorResponse, GenerateRequest,
                            RequestTextDelta, TextDeltas)
from shared.logging import get_logger
from shared.sampling_params import SamplingParams
from shared.sockets import bind, bind_address, make_socket, probe_health, unlink_ipc
from shared.stack_config import StackConfig
from services.engine.outputs import CompletionOutput, RequestOutput

log = get_logger("client")


class EngineRequestError(RuntimeError):
    """The stack refused or failed a request; `code` is the HTTP status that fits."""

    def __init__(self, code: int, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class AsyncEngineClient:
    def __init__(self, stack: StackConfig | None = None, output_timeout_s: float = 60.0):
        """`output_timeout_s`: a request with no output for this long ends with an error
        (the engine stopped answering) and is aborted."""
        self.stack = stack or StackConfig()
        self.output_timeout_s = output_timeout_s
        self.ctx = zmq.asyncio.Context()
        self.requests = make_socket(self.ctx, zmq.PUSH)
        self.requests.connect(self.stack.request_input)
        self.engine = make_socket(self.ctx, zmq.PUSH)
        self.engine.connect(self.stack.engine_input)
        self.results = make_socket(self.ctx, zmq.PULL)
        if self.stack.request_input.startswith("tcp://"):
            port = self.results.bind_to_random_port(
                bind_address(f"tcp://{self.stack.return_host}:0").rsplit(":", 1)[0])
            self.gateway_id = f"tcp://{self.stack.return_host}:{port}"
        else:
            self.gateway_id = f"ipc://{os.path.join(self.stack.run_dir, f'client-{uuid.uuid4().hex[:12]}.sock')}"
            bind(self.results, self.gateway_id)
        self.streams: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.closed = False

    # -- public API ----------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int] | list[dict] | list[ChatMessage],
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs whose completions hold the *new* text and tokens of each step;
        the last one has `finished=True`. Leaving the loop early aborts the request."""
        self._ensure_reader()
        params = sampling_params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = [ChatMessage(m["role"], m["content"]) for m in prompt]
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        finished = False
        try:
            await self.requests.send(encode(GenerateRequest(
                request_id, self.gateway_id, prompt, params, time.time())))
            done: set[int] = set()
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self.output_timeout_s)
                except asyncio.TimeoutError:
                    raise EngineRequestError(
                        503, f"no output from the engine for {self.output_timeout_s:.0f} s",
                        request_id) from None
                if isinstance(item, ErrorResponse):
                    finished = True  # the stack already dropped it
                    raise EngineRequestError(item.code, item.message, request_id)
                out = self._request_output(item, done, params.n)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished and not self.closed:
                with contextlib.suppress(Exception):
                    await self.abort(request_id)

    async def abort(self, request_id: str | list[str], reason: str = "client gone") -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self.engine.send(encode(AbortRequest(ids, reason)))

    async def health(self, timeout_s: float = 1.0):
        """The engine's HealthResponse (with its counts of live peers), or None if it is down."""
        return await asyncio.to_thread(probe_health, self.stack.engine_control, timeout_s)

    def close(self) -> None:
        self.closed = True
        if self._reader is not None:
            self._reader.cancel()
        for sock in (self.requests, self.engine, self.results):
            sock.close(0)
        self.ctx.term()
        unlink_ipc(self.gateway_id)

    # -- internals -----------------------------------------------------------------------------
    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_results())

    async def _read_results(self) -> None:
        while True:
            frame = await self.results.recv()
            try:
                msg = decode(frame, (TextDeltas, ErrorResponse))
            except CodecError as e:
                log.warning("dropped a bad frame", error=str(e))
                continue
            if isinstance(msg, ErrorResponse):
                queue = self.streams.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait(msg)
                continue
            for delta in msg.requests:
                queue = self.streams.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)

    @staticmethod
    def _request_output(delta: RequestTextDelta, done: set[int], n: int) -> RequestOutput:
        completions = []
        for s in delta.sequences:
            logprobs = texts = None
            if s.logprobs:
                logprobs, texts = [], []
                for k, tok in enumerate(s.token_ids):
                    lp = dict(zip(s.top_token_ids[k], s.top_logprobs[k]))
                    lp[tok] = s.logprobs[k]
                    tx = dict(zip(s.top_token_ids[k], s.top_token_texts[k]))
                    tx[tok] = s.token_texts[k]
                    logprobs.append(lp)
                    texts.append(tx)
            completions.append(CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.token_ids), cumulative_logprob=None,
                logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                logprob_texts=texts))
            if s.finish_reason is not None:
                done.add(s.index)
        return RequestOutput(
            request_id=delta.request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None,
            outputs=completions, finished=len(done) >= n,
            num_prompt_tokens=delta.usage.prompt_tokens,
            num_output_tokens=delta.usage.completion_tokens)

