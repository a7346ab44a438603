"""OpenAI requests -> SamplingParams and engine requests; engine outputs -> OpenAI responses and
stream chunks (`/v1/completions`, `/v1/chat/completions`).

Choice indices follow OpenAI: with P prompts and n samples each, prompt i's sample j is choice
i * n + j. Usage adds up every prompt's tokens.
"""
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from proto.requests import PromptOptions
from shared.outputs import CompletionOutput, RequestOutput
from services.gateway.chat_tools import (ChatOutput, ChatRequestError, ChatSettings,
                                         MessageParts, chat_prompt, tool_plan, with_tool_grammar)
from services.gateway.client import EngineRequestError
from services.gateway.extensions import (ExtensionError, best_of_order, check_best_of,
                                         check_prompt_logprobs,
                                         check_refused, check_stream_options, echo_logprobs,
                                         prompt_options, sampled_logprob_sum, token_names,
                                         vllm_prompt_logprobs, with_extensions)
from services.gateway.metrics import GatewayMetrics
from services.gateway.schemas import (ChatCompletionChunk, ChatCompletionChoice,
                                      ChatCompletionRequest, ChatCompletionResponse,
                                      ChatMessage, ChoiceLogprobs,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse, CompletionStreamResponse,
                                      FunctionCall, TokenLogprob, ToolCall, TopLogprob, UsageInfo,
                                      now_s)
from services.gateway.stream_chunks import (CompletionDelta, chat_choice, chunk_head,
                                            delta_dict, usage_dict)
from services.gateway.streaming import (NOT_READY, ClientDisconnected, EngineStreams,
                                        EventStreamResponse, sse_event, unless_disconnected)
from shared.logging import get_logger
from shared.sampling_params import SamplingParams, SamplingParamsError
from shared.structured_output import StructuredOutputsParams, check_supported

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
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured_outputs=_structured_outputs(req), logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids)
    for name in _OPTIONAL_FLOATS:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as e:
        param = rename.get(e.field, e.field)
        raise APIError(400, str(e).replace(e.field, param, 1), param=param) from None


def _structured_outputs(req: CompletionRequest | ChatCompletionRequest
                        ) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` or OpenAI's `response_format`, checked against what the
    grammar library can honour (a 400 names what it cannot)."""
    fmt, so = req.response_format, req.structured_outputs
    from_format = fmt is not None and fmt.type != "text"
    if from_format and so is not None:
        raise APIError(400, "response_format: give response_format or structured_outputs, "
                            "not both", param="response_format")
    try:
        if so is not None:
            fields = so.model_dump(exclude_none=True, exclude_defaults=True)
            if "json_schema" in fields:
                schema = fields.pop("json_schema")
                fields["json"] = schema if isinstance(schema, (dict, str)) else json.dumps(schema)
            params = StructuredOutputsParams(**fields)
        elif from_format and fmt.type == "json_object":
            params = StructuredOutputsParams(json_object=True)
        elif from_format:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError(400, "response_format.json_schema: the json_schema type needs "
                                    "json_schema.schema", param="response_format.json_schema")
            params = StructuredOutputsParams(json=fmt.json_schema.json_schema)
        else:
            return None
        check_supported(params)
    except SamplingParamsError as e:
        param = e.field
        if so is None:  # name the field the request used
            param = param.replace("structured_outputs.json", "response_format.json_schema.schema"
                                  ).replace("structured_outputs", "response_format")
        raise APIError(400, str(e).replace(e.field, param, 1), param=param) from None
    return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias: keys must be token ids (integers, as strings)",
                       param="logit_bias") from None


def _refuse_unsupported(req, checks: dict[str, tuple[bool, str]]) -> None:
    for param, (refused, why) in checks.items():
        if refused:
            raise APIError(400, f"{param}: {why}", param=param)
    with extension_errors():
        check_stream_options(req)
        check_refused(req)
        check_prompt_logprobs(req)


@contextlib.contextmanager
def extension_errors():
    """An ExtensionError raised inside becomes a 400 that names its field."""
    try:
        yield
    except ExtensionError as e:
        raise APIError(400, str(e), param=e.param) from None


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    _refuse_unsupported(req, {})
    with extension_errors():
        check_best_of(req)
    params = _sampling_params(req, req.max_tokens, req.logprobs, rename={})
    # echo with logprobs returns the prompt's logprobs too; best_of ranks samples by theirs.
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None)
             if k is not None]
    best_of = req.best_of if req.best_of is not None and req.best_of > req.n else None
    with extension_errors():
        return with_extensions(params, prompt_logprobs=max(asked) if asked else None,
                               best_of=best_of, logprobs=0 if best_of else None)


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    _refuse_unsupported(req, {
        "top_logprobs": (req.top_logprobs is not None and not req.logprobs,
                         "top_logprobs needs logprobs to be true"),
    })
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rename = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    params = _sampling_params(req, max_tokens, logprobs, rename)
    with extension_errors():
        return with_extensions(params, prompt_logprobs=req.prompt_logprobs)


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
        self.model_names = {model_name}  # every name requests may use (the app adds aliases)
        self.metrics = metrics
        self.decode_prompt = decode_prompt
        self.disconnect_poll_s = disconnect_poll_s
        # The model's fill-in-the-middle tokens (prefix, suffix, middle), or None: set by the app.
        self.fim_tokens: Callable[[], Awaitable[tuple[str, str, str] | None]] | None = None

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


async def stream_events(first, streams: EngineStreams, num_prompts: int,
                        events_of: Callable[[int, RequestOutput], Iterable[str]],
                        usage_event: Callable[[UsageInfo], str] | None,
                        opening: Iterable[str] = ()) -> AsyncIterator[str]:
    """A streamed response's server-sent events, for either endpoint: `opening`, then
    `events_of(prompt_index, output)` for each engine output from `first` on, the usage event
    (when the client asked for one), an error event if the engine request fails midway, and
    [DONE]. The events of every output already here go out together, in one write."""
    usage = UsageTally(num_prompts)
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


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request, request_id: str,
                     release: Callable[[], None]) -> Response:
        self.check_model(req.model)
        params = completion_sampling_params(req)
        prompts = completion_prompts(req.prompt)
        if req.suffix:
            prompts = [await self._fill_in_the_middle(p, req.suffix) for p in prompts]
        echo = [await self._prompt_text(p) for p in prompts] if req.echo else None
        response_id, created = f"cmpl-{request_id}", now_s()
        n, samples = req.n, params.n  # samples: best_of, when the best n of more are returned
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous_usage = include_usage and req.stream_options.continuous_usage_stats
        echo_with_logprobs = req.echo and req.logprobs is not None
        firsts: dict[int, RequestOutput] = {}  # each prompt's first output (its prompt's part)

        def choice_delta(i: int, c: CompletionOutput,
                         state: ChoiceState) -> CompletionDelta | None:
            text, logprobs, extras = c.text, None, {}
            if not state.started:
                first = firsts[i]
                if echo is not None:
                    text = echo[i] + text
                    state.text_offset = len(echo[i])
                if echo_with_logprobs and first.prompt_logprobs is not None:
                    logprobs = echo_logprobs(first, req.return_tokens_as_token_ids,
                                             req.logprobs)
                if req.return_token_ids:
                    extras["prompt_token_ids"] = first.prompt_token_ids
                if req.prompt_logprobs is not None:
                    extras["prompt_logprobs"] = vllm_prompt_logprobs(
                        first, req.prompt_logprobs, params.prompt_logprobs)
            state.started = True
            state.cumulative_logprob += sampled_logprob_sum(c)
            if req.logprobs is not None and c.logprobs:
                more, state.text_offset = completion_logprobs(c, state.text_offset,
                                                              req.return_tokens_as_token_ids)
                if logprobs is None:
                    logprobs = more
                else:
                    _extend_logprobs(logprobs, more)
            if req.return_token_ids:
                extras["token_ids"] = list(c.token_ids)
            if not (text or logprobs is not None or c.finish_reason is not None
                    or any(extras.values())):
                return None
            return CompletionDelta(i * n + c.index, text, logprobs, c.finish_reason,
                                   c.stop_reason, extras)

        def body(first, streams: EngineStreams) -> AsyncIterator[str]:
            states = [ChoiceState() for _ in range(len(prompts) * n)]
            head = chunk_head(response_id, "text_completion", created, self.model_name)

            def events_of(i: int, out: RequestOutput) -> Iterator[str]:
                firsts.setdefault(i, out)
                for c in out.outputs:
                    choice = choice_delta(i, c, states[i * n + c.index])
                    if choice is not None:
                        chunk = {**head, "choices": [choice.to_dict()]}
                        if include_usage:
                            chunk["usage"] = usage_dict(out) if continuous_usage else None
                        yield sse_event(chunk)

            def usage_event(usage: UsageInfo) -> str:
                return sse_event(CompletionStreamResponse(
                    id=response_id, created=created, model=self.model_name, choices=[],
                    usage=usage).model_dump())

            return stream_events(first, streams, len(prompts), events_of,
                                 usage_event if include_usage else None)

        def response(outputs) -> JSONResponse:
            states = [ChoiceState() for _ in range(len(prompts) * samples)]
            usage = UsageTally(len(prompts))
            for i, out in outputs:
                usage.add(i, out)
                firsts.setdefault(i, out)
                for c in out.outputs:
                    state = states[i * samples + c.index]
                    choice = choice_delta(i, c, state)
                    if choice is None:
                        continue
                    state.text.append(choice.text)
                    if choice.logprobs is not None:
                        if state.completion_logprobs is None:
                            state.completion_logprobs = CompletionLogprobs()
                        _extend_logprobs(state.completion_logprobs, choice.logprobs)
                    _keep_extras(state, choice.extras)
                    if c.finish_reason is not None:
                        state.finish_reason, state.stop_reason = c.finish_reason, c.stop_reason
            choices = []
            for i in range(len(prompts)):
                group = states[i * samples:(i + 1) * samples]
                # best_of: the n samples with the highest cumulative logprob, best first.
                order = (best_of_order([s.cumulative_logprob for s in group], n)
                         if samples > n else range(n))
                for j, k in enumerate(order):
                    s = group[k]
                    choices.append(CompletionChoice(
                        index=i * n + j, text="".join(s.text), logprobs=s.completion_logprobs,
                        finish_reason=s.finish_reason, stop_reason=s.stop_reason, **s.extras))
            return JSONResponse(CompletionResponse(
                id=response_id, created=created, model=self.model_name, choices=choices,
                usage=usage.info()).model_dump())

        return await self.run(raw, prompts, params, response_id, req.stream, release, body,
                              response, req.cache_salt, prompt_options(req))

    async def _fill_in_the_middle(self, prompt: str | list[int], suffix: str) -> str:
        """The prompt of a fill-in-the-middle request, in the model's own FIM tokens."""
        tokens = await self.fim_tokens() if self.fim_tokens is not None else None
        if tokens is None:
            raise APIError(400, "suffix: this model has no fill-in-the-middle tokens, so a "
                                "suffix cannot be served", param="suffix")
        if not isinstance(prompt, str):
            raise APIError(400, "suffix: needs a text prompt", param="suffix")
        fim_prefix, fim_suffix, fim_middle = tokens
        return f"{fim_prefix}{prompt}{fim_suffix}{suffix}{fim_middle}"

    async def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if self.decode_prompt is None:
            raise APIError(400, "echo: echo of token-id prompts needs the gateway's tokenizer",
                           param="echo")
        return await self.decode_prompt(prompt)


class ChatServing(OpenAIServing):
    def __init__(self, *args, chat_settings: ChatSettings | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_settings = chat_settings or ChatSettings()

    async def create(self, req: ChatCompletionRequest, raw: Request, request_id: str,
                     release: Callable[[], None]) -> Response:
        self.check_model(req.model)
        params = chat_sampling_params(req)
        try:  # tools, reasoning and template options: see chat_tools
            prompt = chat_prompt(req, self.chat_settings)
            plan = tool_plan(req, self.chat_settings)
            params = with_tool_grammar(params, plan)
        except ChatRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        reading = ChatOutput(req, plan, self.chat_settings)
        choice_streams = [reading.stream() for _ in range(req.n)]
        response_id, created = f"chatcmpl-{request_id}", now_s()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        top_n = req.top_logprobs or 0
        continuous_usage = include_usage and req.stream_options.continuous_usage_stats

        def logprobs_of(c: CompletionOutput) -> list[TokenLogprob] | None:
            if not (req.logprobs and c.logprobs):
                return None
            return chat_logprobs(c, top_n, req.return_tokens_as_token_ids)

        def token_ids_of(c: CompletionOutput) -> dict:
            return {"token_ids": list(c.token_ids)} if req.return_token_ids else {}

        def prompt_parts(first: RequestOutput) -> dict:
            """vLLM's response-level fields: the prompt's token ids and logprobs."""
            parts = {}
            if req.return_token_ids:
                parts["prompt_token_ids"] = first.prompt_token_ids
            if req.prompt_logprobs is not None and not req.stream:
                parts["prompt_logprobs"] = vllm_prompt_logprobs(first, params.prompt_logprobs)
            return parts

        head = chunk_head(response_id, "chat.completion.chunk", created, self.model_name)

        def chunk(choice: dict, out: RequestOutput | None = None, opening: bool = False,
                  **parts) -> str:
            data = {**head, "choices": [choice]}
            if include_usage:
                # An opening chunk (the role, an echo) comes before any output token.
                data["usage"] = (usage_dict(out, with_output=not opening)
                                 if continuous_usage and out is not None else None)
            data.update(parts)  # vLLM's fields come after the declared ones
            return sse_event(data)

        def events_of(_: int, out: RequestOutput) -> Iterator[str]:
            for c in out.outputs:
                logprobs = logprobs_of(c)
                cs = choice_streams[c.index]
                delta = delta_dict(cs.feed(c.text, final=c.finish_reason is not None))
                if (delta is None and logprobs is None and c.finish_reason is None
                        and not (req.return_token_ids and c.token_ids)):
                    continue
                yield chunk(chat_choice(
                    c.index, delta or {}, logprobs,
                    reading.finish_reason(c.finish_reason, cs.made_calls), c.stop_reason,
                    **token_ids_of(c)), out)

        def usage_event(usage: UsageInfo) -> str:
            return sse_event(ChatCompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=[],
                usage=usage).model_dump())

        def body(first, streams: EngineStreams) -> AsyncIterator[str]:
            # Each choice opens with the assistant's role, as OpenAI's streams do.
            opening = [chunk(chat_choice(index, {"role": "assistant", "content": ""}),
                             first[1], opening=True, **prompt_parts(first[1]))
                       for index in range(req.n)]
            for index, cs in enumerate(choice_streams):
                echo = cs.opening()
                if echo is not None:
                    opening.append(chunk(chat_choice(index, delta_dict(echo)), first[1],
                                         opening=True))
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
                    state.token_ids += c.token_ids
                    logprobs = logprobs_of(c)
                    if logprobs:
                        state.chat_logprobs = (state.chat_logprobs or []) + logprobs
                    if c.finish_reason is not None:
                        state.finish_reason, state.stop_reason = c.finish_reason, c.stop_reason
            messages = [reading.message("".join(s.text)) for s in states]
            choices = [ChatCompletionChoice(
                index=k, message=chat_message(messages[k]),
                logprobs=ChoiceLogprobs(content=s.chat_logprobs or []) if req.logprobs else None,
                finish_reason=reading.finish_reason(s.finish_reason, bool(messages[k].tool_calls)),
                stop_reason=s.stop_reason,
                **({"token_ids": s.token_ids} if req.return_token_ids else {}))
                for k, s in enumerate(states)]
            return JSONResponse(ChatCompletionResponse(
                id=response_id, created=created, model=self.model_name, choices=choices,
                usage=usage.info(), **prompt_parts(outputs[0][1])).model_dump())

        return await self.run(raw, [prompt], params, response_id, req.stream, release, body,
                              response, req.cache_salt, prompt_options(req))


def chat_message(parts: MessageParts) -> ChatMessage:
    return ChatMessage(content=parts.content, reasoning_content=parts.reasoning_content,
                       tool_calls=[ToolCall(id=c.id, function=FunctionCall(
                           name=c.name, arguments=c.arguments)) for c in parts.tool_calls])


def _keep_extras(state: ChoiceState, extras: dict) -> None:
    """Fold a delta's vLLM fields into its choice: the prompt's parts once, token ids added."""
    for key, value in extras.items():
        if key == "token_ids":
            state.token_ids += value
            state.extras["token_ids"] = state.token_ids
        else:
            state.extras.setdefault(key, value)


def _extend_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset
