"""What the two generation endpoints share (serving_completion.py, serving_chat.py): starting
their engine requests and waiting for them, a choice's state, the usage tally, a stream's
events, and engine logprobs as OpenAI's two logprob forms. Requests become SamplingParams in
request_params.py.

Choice indices follow OpenAI: with P prompts and n samples each, prompt i's sample j is choice
i * n + j. Usage adds up every prompt's tokens.
"""
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from proto.requests import PromptOptions
from shared.outputs import CompletionOutput, RequestOutput
from services.gateway.api_errors import APIError, api_error_from_engine, error_body
from services.gateway.client import EngineRequestError
from services.gateway.extensions import token_names
from services.gateway.metrics import GatewayMetrics
from services.gateway.schemas import (CompletionLogprobs, PromptTokensDetails, TokenLogprob,
                                      TopLogprob, UsageInfo)
from services.gateway.streaming import (NOT_READY, ClientDisconnected, EngineStreams,
                                        EventStreamResponse, sse_event, unless_disconnected)
from shared.logging import get_logger
from shared.sampling_params import SamplingParams

log = get_logger("gateway")


# -- outputs -> logprobs --------------------------------------------------------------------------
def completion_logprobs(c: CompletionOutput, text_offset: int,
                        as_ids: bool = False) -> tuple[CompletionLogprobs, int]:
    """The legacy completions logprobs of a delta's tokens; offsets continue from `text_offset`.
    `as_ids` (vLLM's return_tokens_as_token_ids): tokens named `token_id:<id>`."""
    lp = CompletionLogprobs()
    for k, token in enumerate(c.token_ids):
        logprobs, texts = c.logprobs[k], c.logprob_texts[k]
        name, text = token_names(texts, as_ids), texts[token]
        lp.tokens.append(name(token))
        lp.token_logprobs.append(logprobs[token])
        lp.top_logprobs.append({name(t): v for t, v in sorted(logprobs.items(),
                                                              key=lambda kv: -kv[1])})
        lp.text_offset.append(text_offset)
        text_offset += len(text)
    return lp, text_offset


def chat_logprobs(c: CompletionOutput, top_n: int, as_ids: bool = False) -> list[TokenLogprob]:
    entries = []
    for k, token in enumerate(c.token_ids):
        logprobs, name = c.logprobs[k], token_names(c.logprob_texts[k], as_ids)
        top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append(TokenLogprob(
            token=name(token), logprob=logprobs[token], bytes=list(name(token).encode()),
            top_logprobs=[TopLogprob(token=name(t), logprob=v, bytes=list(name(t).encode()))
                          for t, v in top]))
    return entries


# -- serving --------------------------------------------------------------------------------------
@dataclass
class ChoiceState:
    """One choice's output so far (non-streamed responses, and offsets for streams)."""
    text: list[str] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs | None = None
    chat_logprobs: list[TokenLogprob] | None = None
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # a stream has sent this choice's first chunk (its echo or role)
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # of the sampled tokens (with logprobs asked for)
    extras: dict = field(default_factory=dict)  # vLLM's fields of the choice (prompt_token_ids)


class UsageTally:
    """A response's usage over its engine requests (one per prompt); with `details`, also the
    prompt tokens the prefix cache held (reported with each request's first output)."""

    def __init__(self, num_prompts: int, details: bool = False):
        self.prompt = [0] * num_prompts
        self.completion = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.details = details

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        if out.num_prompt_tokens is not None:
            self.prompt[prompt_index] = out.num_prompt_tokens
        if out.num_output_tokens is not None:
            self.completion[prompt_index] = out.num_output_tokens
        if out.num_cached_tokens:
            self.cached[prompt_index] = out.num_cached_tokens

    def info(self) -> UsageInfo:
        p, c = sum(self.prompt), sum(self.completion)
        details = PromptTokensDetails(cached_tokens=sum(self.cached)) if self.details else None
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                         prompt_tokens_details=details)


class OpenAIServing:
    """What both endpoints share: the model check, starting engine requests, waiting for the
    first output (so a bad request is still a plain HTTP error, even when streamed), and the
    request's hold on one of the gateway's pending slots."""

    def __init__(self, client, model_name: str, metrics: GatewayMetrics,
                 decode_prompt: Callable[[list[int]], Awaitable[str]] | None = None,
                 disconnect_poll_s: float = 0.25, prompt_tokens_details: bool = False):
        self.client = client
        self.prompt_tokens_details = prompt_tokens_details  # cached tokens in `usage`
        self.model_name = model_name
        self.model_names = {model_name}  # every name requests may use (the app adds aliases)
        self.metrics = metrics
        self.decode_prompt = decode_prompt
        self.disconnect_poll_s = disconnect_poll_s
        # The model's fill-in-the-middle tokens (prefix, suffix, middle), or None: set by the app.
        self.fim_tokens: Callable[[], Awaitable[tuple[str, str, str] | None]] | None = None

    def usage_tally(self, num_prompts: int) -> UsageTally:
        return UsageTally(num_prompts, self.prompt_tokens_details)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    async def run(self, raw: Request, prompts: list, params: SamplingParams, request_id: str,
                  stream: bool, release: Callable[[], None], make_body, make_response,
                  cache_salt: str | None = None,
                  options: PromptOptions | None = None) -> Response:
        """Start the engine requests; answer with `make_response(outputs)` or, streamed, with
        the events of `make_body(first_output, streams)`. `release` frees the pending slot once
        the response is over, whichever way it ends."""
        arrival = time.monotonic()
        streams = EngineStreams(self.client, prompts, params, request_id, self.metrics, arrival,
                                cache_salt, options)
        handed_over = False
        try:
            if stream:
                first = await unless_disconnected(streams.next(), raw, self.disconnect_poll_s)
                body = make_body(first, streams)
                handed_over = True  # from here the response's close frees the slot
                return EventStreamResponse(body, on_close=lambda: (streams.close(), release()))
            outputs = await unless_disconnected(streams.collect(), raw, self.disconnect_poll_s)
            return make_response(outputs)
        except ClientDisconnected:
            log.info("client disconnected; request aborted")
            return Response(status_code=499)
        except EngineRequestError as e:
            raise api_error_from_engine(e) from None
        finally:
            if not handed_over:
                streams.close()
                release()


async def stream_events(first, streams: EngineStreams, usage: UsageTally,
                        events_of: Callable[[int, RequestOutput], Iterable[str]],
                        usage_event: Callable[[UsageInfo], str] | None,
                        opening: Iterable[str] = ()) -> AsyncIterator[str]:
    """A streamed response's server-sent events, for either endpoint: `opening`, then
    `events_of(prompt_index, output)` for each engine output from `first` on, the usage event
    (when the client asked for one; `usage` tallies it), an error event if the engine request
    fails midway, and [DONE]. The events of every output already here go out together, in one
    write."""
    events = list(opening)
    try:
        item = first
        while item is not None:
            i, out = item
            usage.add(i, out)
            events.extend(events_of(i, out))
            item = streams.next_ready()
            if item is NOT_READY:
                if events:
                    yield "".join(events)
                    events = []
                item = await streams.next()
        if usage_event is not None:
            events.append(usage_event(usage.info()))
    except EngineRequestError as e:
        events.append(_stream_error_event(e))
    events.append(sse_event("[DONE]"))
    yield "".join(events)


def _stream_error_event(e: EngineRequestError) -> str:
    err = api_error_from_engine(e)
    log.warning("stream ended with an error", status=err.status, error=err.message)
    return sse_event(error_body(err.status, err.message, err.param, err.code))
