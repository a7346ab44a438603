"""Plumbing between HTTP requests and engine requests: merged output streams, SSE responses, and
waiting that notices a client going away.

Each engine request runs in its own asyncio task, never in the HTTP handler's task: when the
client goes away, Starlette cancels the handler's task scope, and cancellation there would also
cut short the awaits that abort the request in the engine. Cancelling our own task instead lets
`AsyncEngineClient.generate` run its cleanup (the abort) to the end.
"""
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from proto.requests import PromptOptions
from shared.outputs import RequestOutput
from services.gateway.client import EngineRequestError
from services.gateway.metrics import GatewayMetrics, RequestTimer
from shared.logging import get_logger
from shared.sampling_params import SamplingParams

log = get_logger("gateway")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


NOT_READY = object()  # EngineStreams.next_ready: no output has come yet


class EngineStreams:
    """One engine request per prompt, each pumped by its own task into one queue, so the outputs
    of all prompts come out in the order they arrive. `close()` aborts whatever still runs."""

    def __init__(self, client, prompts: list, params: SamplingParams, request_id: str,
                 metrics: GatewayMetrics, arrival: float, cache_salt: str | None = None,
                 prompt_options: PromptOptions | None = None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_open = len(prompts)
        self.tasks = [
            asyncio.create_task(self._pump(client, i, prompt, params, f"{request_id}-{i}",
                                           metrics, RequestTimer(arrival, params=params),
                                           cache_salt, prompt_options))
            for i, prompt in enumerate(prompts)]

    async def _pump(self, client, i: int, prompt, params: SamplingParams, engine_request_id: str,
                    metrics: GatewayMetrics, timer: RequestTimer,
                    cache_salt: str | None, prompt_options: PromptOptions | None) -> None:
        try:
            async for out in client.generate(prompt, params, engine_request_id, cache_salt,
                                             prompt_options):
                metrics.observe_output(timer, out)
                self.queue.put_nowait((i, out))
        except EngineRequestError as e:
            self.queue.put_nowait((i, e))
        except Exception as e:  # a bug must end the request with an error, not hang it
            log.exception("engine request failed", engine_request_id=engine_request_id)
            self.queue.put_nowait((i, EngineRequestError(500, f"internal error: {e}")))
        finally:
            self.queue.put_nowait((i, None))  # this prompt's stream has ended

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt index, output); None when every prompt has finished. An engine
        error of any prompt is raised here."""
        while self.num_open:
            if (output := self._take(*await self.queue.get())) is not None:
                return output
        return None

    def next_ready(self) -> tuple[int, RequestOutput] | None | object:
        """`next()` without waiting: the next output if one is already here; None when every
        prompt has finished; NOT_READY when the next one has yet to come."""
        while self.num_open and not self.queue.empty():
            if (output := self._take(*self.queue.get_nowait())) is not None:
                return output
        return NOT_READY if self.num_open else None

    def _take(self, i: int, item) -> tuple[int, RequestOutput] | None:
        """One queued item: (prompt index, output); None for a prompt's end (counted); an
        engine error is raised."""
        if item is None:
            self.num_open -= 1
            return None
        if isinstance(item, Exception):
            raise item
        return i, item

    async def collect(self) -> list[tuple[int, RequestOutput]]:
        outputs = []
        while (item := await self.next()) is not None:
            outputs.append(item)
        return outputs

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


async def unless_disconnected(awaitable: Awaitable, request: Request, poll_s: float = 0.25):
    """Await `awaitable`; raises ClientDisconnected (and cancels the awaitable) when the client
    is gone. The server's `http.disconnect` message is awaited (the body has been read, so
    nothing else comes), so a client that leaves is noticed at once rather than at the next
    poll. `poll_s` is no longer used; it stays for the callers that pass it."""
    task = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# The scope key of the `send` a stream's body chunks may go through (set by the gateway's
# request middleware, outside the framework's own wrappers); without it they take the usual one.
BODY_SEND_KEY = "pagoda.body_send"


def sse_event(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return f"data: {payload}\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose end, however it comes (done, client gone, server stopping),
    closes the body generator and then calls `on_close`.

    It listens for the client's disconnect itself, so a client that leaves while no event is
    due (a request still queued) is noticed at once, not at the next write.
    """

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict | None = None):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self.body = body
        self.on_close = on_close

    async def stream_events(self, send: Send, body_send: Send) -> None:
        """StreamingResponse's `stream_response`, but the body through `body_send`: the start
        message goes through every wrapper (the request id header, the status they log and
        track), and then each chunk costs one call, not one per middleware layer."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self.body:
            await body_send({"type": "http.response.body", "body": event.encode(),
                             "more_body": True})
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body_send = scope.get(BODY_SEND_KEY, send)
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_events(send, body_send)
                    except OSError:
                        pass  # the client went away mid-write
                    finally:
                        group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            # The generator's own cleanup (closing its EngineStreams) awaits nothing, so it
            # runs to the end even inside a cancelled scope.
            await self.body.aclose()
            self.on_close()
