"""OpenAI requests -> SamplingParams and engine requests; engine outputs -> OpenAI responses and
stream chunks (`/v1/completions`, `/v1/chat/completions`).

Choice indices follow OpenAI: with P prompts and n samples each, prompt i's sample j is choice
i * n + j. Usage adds up every prompt's tokens.
"""
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.engine.outputs import CompletionOutput, RequestOutput
from services.gateway.client import EngineRequestError
from services.gateway.metrics import GatewayMetrics
from services.gateway.schemas import (ChatCompletionChunk, ChatCompletionChoice,
                                      ChatCompletionRequest, ChatCompletionResponse,
                                      ChatCompletionStreamChoice, ChatMessage, ChoiceLogprobs,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse, CompletionStreamResponse, DeltaMessage,
                                      TokenLogprob, TopLogprob, UsageInfo, now_s)
from services.gateway.streaming import (ClientDisconnected, EngineStreams, EventStreamResponse,
                                        sse_event, unless_disconnected)
from shared.logging import get_logger
from shared.sampling_params import SamplingParams, SamplingParamsError

log = get_logger("gateway")

_PARAM_PREFIX = re.compile(r"^([a-z_]+): ")


class APIError(Exception):
    """A request the API refuses; becomes OpenAI's error object with this status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def api_error_from_engine(e: EngineRequestError) -> APIError:
    # The tokenizer's messages start with the field they blame ("prompt: ...").
    match = _PARAM_PREFIX.match(str(e))
    return APIError(e.code, str(e), param=match.group(1) if match else None)


# -- request -> SamplingParams --------------------------------------------------------------------
_OPTIONAL_FLOATS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                     logprobs: int | None, rename: dict[str, str]) -> SamplingParams:
    kwargs = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens)
    for name in _OPTIONAL_FLOATS:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as e:
        param = rename.get(e.field, e.field)
        raise APIError(400, str(e).replace(e.field, param, 1), param=param) from None


def _refuse_unsupported(req, checks: dict[str, tuple[bool, str]]) -> None:
    for param, (refused, why) in checks.items():
        if refused:
            raise APIError(400, f"{param}: {why}", param=param)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed when stream is true",
                       param="stream_options")


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    _refuse_unsupported(req, {
        "best_of": (req.best_of is not None and req.best_of != req.n,
                    "best_of other than n is not supported"),
        "suffix": (bool(req.suffix), "suffix is not supported"),
        "logit_bias": (bool(req.logit_bias), "logit_bias is not supported"),
        "echo": (req.echo and req.logprobs is not None,
                 "echo with logprobs is not supported (prompt logprobs are not returned)"),
    })
    return _sampling_params(req, req.max_tokens, req.logprobs, rename={})


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    _refuse_unsupported(req, {
        "tools": (bool(req.tools), "tool calls are not supported"),
        "tool_choice": (req.tool_choice not in (None, "none"), "tool calls are not supported"),
        "logit_bias": (bool(req.logit_bias), "logit_bias is not supported"),
        "response_format": (req.response_format is not None
                            and req.response_format.get("type") != "text",
                            "only the 'text' response format is supported"),
        "top_logprobs": (req.top_logprobs is not None and not req.logprobs,
                         "top_logprobs needs logprobs to be true"),
    })
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rename = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    return _sampling_params(req, max_tokens, logprobs, rename)


def completion_prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of text or token-id prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]


# -- outputs -> logprobs --------------------------------------------------------------------------
def completion_logprobs(c: CompletionOutput, text_offset: int) -> tuple[CompletionLogprobs, int]:
    """The legacy completions logprobs of a delta's tokens; offsets continue from `text_offset`."""
    lp = CompletionLogprobs()
    for k, token in enumerate(c.token_ids):
        logprobs, texts = c.logprobs[k], c.logprob_texts[k]
        text = texts[token]
        lp.tokens.append(text)
        lp.token_logprobs.append(logprobs[token])
        lp.top_logprobs.append({texts[t]: v for t, v in sorted(logprobs.items(),
                                                               key=lambda kv: -kv[1])})
        lp.text_offset.append(text_offset)
        text_offset += len(text)
    return lp, text_offset


def chat_logprobs(c: CompletionOutput, top_n: int) -> list[TokenLogprob]:
    entries = []
    for k, token in enumerate(c.token_ids):
        logprobs, texts = c.logprobs[k], c.logprob_texts[k]
        top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append(TokenLogprob(
            token=texts[token], logprob=logprobs[token], bytes=list(texts[token].encode()),
            top_logprobs=[TopLogprob(token=texts[t], logprob=v, bytes=list(texts[t].encode()))
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


class UsageTally:
    def __init__(self, num_prompts: int):
        self.prompt = [0] * num_prompts
        self.completion = [0] * num_prompts

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        if out.num_prompt_tokens is not None:
            self.prompt[prompt_index] = out.num_prompt_tokens
        if out.num_output_tokens is not None:
            self.completion[prompt_index] = out.num_output_tokens

    def info(self) -> UsageInfo:
        p, c = sum(self.prompt), sum(self.completion)
        return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


class OpenAIServing:
    """What both endpoints share: the model check, starting engine requests, waiting for the
    first output (so a bad request is still a plain HTTP error, even when streamed), and the
    request's hold on one of the gateway's pending slots."""

    def __init__(self, client, model_name: str, metrics: GatewayMetrics,
                 decode_prompt: Callable[[list[int]], Awaitable[str]] | None = None,
                 disconnect_poll_s: float = 0.25):
        self.client = client
        self.model_name = model_name
        self.metrics = metrics
        self.decode_prompt = decode_prompt
        self.disconnect_poll_s = disconnect_poll_s

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    async def run(self, raw: Request, prompts: list, params: SamplingParams, request_id: str,
                  stream: bool, release: Callable[[], None], make_body, make_response,
                  cache_salt: str | None = None) -> Response:
        """Start the engine requests; answer with `make_response(outputs)` or, streamed, with
        the events of `make_body(first_output, streams)`. `release` frees the pending slot once
        the response is over, whichever way it ends."""
        arrival = time.monotonic()
        streams = EngineStreams(self.client, prompts, params, request_id, self.metrics, arrival,
                                cache_salt)
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


async def stream_events(first, streams: EngineStreams, num_prompts: int,
                        events_of: Callable[[int, RequestOutput], Iterable[str]],
                        usage_event: Callable[[UsageInfo], str] | None,
                        opening: Iterable[str] = ()) -> AsyncIterator[str]:
    """A streamed response's server-sent events, for either endpoint: `opening`, then
    `events_of(prompt_index, output)` for each engine output from `first` on, the usage event
    (when the client asked for one), an error event if the engine request fails midway, and
    [DONE]."""
    usage = UsageTally(num_prompts)
    try:
        for event in opening:
            yield event
        item = first
        while item is not None:
            i, out = item
            usage.add(i, out)
            for event in events_of(i, out):
                yield event
            item = await streams.next()
        if usage_event is not None:
            yield usage_event(usage.info())
    except EngineRequestError as e:
        yield _stream_error_event(e)
    yield sse_event("[DONE]")


def _stream_error_event(e: EngineRequestError) -> str:
    err = api_error_from_engine(e)
    log.warning("stream ended with an error", status=err.status, error=err.message)
    return sse_event(error_body(err.status, err.message, err.param, err.code))


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request, request_id: str,
                     release: Callable[[], None]) -> Response:
        self.check_model(req.model)
        params = completion_sampling_params(req)
        prompts = completion_prompts(req.prompt)
        echo = [await self._prompt_text(p) for p in prompts] if req.echo else None
        response_id, created = f"cmpl-{request_id}", now_s()
        n = req.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def choice_delta(i: int, c: CompletionOutput,
                         state: ChoiceState) -> CompletionChoice | None:
            text = c.text
            if echo is not None and not state.started:
                text = echo[i] + text
                state.text_offset = len(echo[i])
            state.started = True
            logprobs = None
            if req.logprobs is not None and c.logprobs:
                logprobs, state.text_offset = completion_logprobs(c, state.text_offset)
            if not text and logprobs is None and c.finish_reason is None:
                return None
            return CompletionChoice(index=i * n + c.index, text=text, logprobs=logprobs,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)

        def body(first, streams: EngineStreams) -> AsyncIterator[str]:
            states = [ChoiceState() for _ in range(len(prompts) * n)]

            def events_of(i: int, out: RequestOutput) -> Iterator[str]:
                for c in out.outputs:
                    choice = choice_delta(i, c, states[i * n + c.index])
                    if choice is not None:
                        yield sse_event(_chunk_dict(CompletionStreamResponse(
                            id=response_id, created=created, model=self.model_name,
                            choices=[choice]), include_usage))

            def usage_event(usage: UsageInfo) -> str:
                return sse_event(CompletionStreamResponse(
                    id=response_id, created=created, model=self.model_name, choices=[],
                    usage=usage).model_dump())

            return stream_events(first, streams, len(prompts), events_of,
                                 usage_event if include_usage else None)

        def response(outputs) -> JSONResponse:
            states = [ChoiceState() for _ in range(len(prompts) * n)]
            usage = UsageTally(len(prompts))
            for i, out in outputs:
                usage.add(i, out)
                for c in out.outputs:
                    state = states[i * n + c.index]
                    choice = choice_delta(i, c, state)
                    if choice is None:
                        continue
                    state.text.append(choice.text)
                    if choice.logprobs is not None:
                        if state.completion_logprobs is None:
                            state.completion_logprobs = CompletionLogprobs()
                        _extend_logprobs(state.completion_logprobs, choice.logprobs)
                    if c.finish_reason is not None:
                        state.finish_reason, state.stop_reason = c.finish_reason, c.stop_reason
            choices = [CompletionChoice(index=k, text="".join(s.text),
                                        logprobs=s.completion_logprobs,
                                        finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                       for k, s in enumerate(states)]
            return JSONResponse(CompletionResponse(
                id=response_id, created=created, model=self.model_name, choices=choices,
                usage=usage.info()).model_dump())

        return await self.run(raw, prompts, params, response_id, req.stream, release, body,
                              response, req.cache_salt)

    async def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if self.decode_prompt is None:
            raise APIError(400, "echo: echo of token-id prompts needs the gateway's tokenizer",
                           param="echo")
        return await self.decode_prompt(prompt)


class ChatServing(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw: Request, request_id: str,
                     release: Callable[[], None]) -> Response:
        self.check_model(req.model)
        params = chat_sampling_params(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        response_id, created = f"chatcmpl-{request_id}", now_s()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        top_n = req.top_logprobs or 0

        def logprobs_of(c: CompletionOutput) -> list[TokenLogprob] | None:
            return chat_logprobs(c, top_n) if req.logprobs and c.logprobs else None

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse_event(_chunk_dict(ChatCompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=[choice]),
                include_usage))

        def events_of(_: int, out: RequestOutput) -> Iterator[str]:
            for c in out.outputs:
                logprobs = logprobs_of(c)
                if not c.text and logprobs is None and c.finish_reason is None:
                    continue
                yield chunk(ChatCompletionStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.text or None),
                    logprobs=ChoiceLogprobs(content=logprobs) if logprobs else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))

        def usage_event(usage: UsageInfo) -> str:
            return sse_event(ChatCompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=[],
                usage=usage).model_dump())

        def body(first, streams: EngineStreams) -> AsyncIterator[str]:
            # Each choice opens with the assistant's role, as OpenAI's streams do.
            opening = [chunk(ChatCompletionStreamChoice(
                index=index, delta=DeltaMessage(role="assistant", content="")))
                for index in range(req.n)]
            return stream_events(first, streams, 1, events_of,
                                 usage_event if include_usage else None, opening)

        def response(outputs) -> JSONResponse:
            states = [ChoiceState() for _ in range(req.n)]
            usage = UsageTally(1)
            for _, out in outputs:
                usage.add(0, out)
                for c in out.outputs:
                    state = states[c.index]
                    state.text.append(c.text)
                    logprobs = logprobs_of(c)
                    if logprobs:
                        state.chat_logprobs = (state.chat_logprobs or []) + logprobs
                    if c.finish_reason is not None:
                        state.finish_reason, state.stop_reason = c.finish_reason, c.stop_reason
            choices = [ChatCompletionChoice(
                index=k, message=ChatMessage(content="".join(s.text)),
                logprobs=ChoiceLogprobs(content=s.chat_logprobs or []) if req.logprobs else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for k, s in enumerate(states)]
            return JSONResponse(ChatCompletionResponse(
                id=response_id, created=created, model=self.model_name, choices=choices,
                usage=usage.info()).model_dump())

        return await self.run(raw, [messages], params, response_id, req.stream, release, body,
                              response, req.cache_salt)


def _extend_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


def _chunk_dict(chunk, include_usage: bool) -> dict:
    """A stream chunk as OpenAI sends it: `usage: null` only when the final usage chunk was
    asked for, and a chat delta without its unset fields."""
    data = chunk.model_dump(exclude=None if include_usage else {"usage"})
    for choice in data["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return data
