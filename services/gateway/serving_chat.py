"""`/v1/chat/completions`: messages -> one prompt through the chat template (tools and
reasoning as chat_tools reads them); its outputs -> a chat response or its stream chunks."""
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shared.outputs import CompletionOutput, RequestOutput
from services.gateway.api_errors import APIError
from services.gateway.chat_tools import (ChatOutput, ChatRequestError, ChatSettings,
                                         MessageParts, chat_prompt, tool_plan, with_tool_grammar)
from services.gateway.extensions import prompt_options, vllm_prompt_logprobs
from services.gateway.openai_serving import (ChoiceState, OpenAIServing, chat_logprobs,
                                             stream_events)
from services.gateway.request_params import chat_sampling_params
from services.gateway.schemas import (ChatCompletionChunk, ChatCompletionChoice,
                                      ChatCompletionRequest, ChatCompletionResponse,
                                      ChatMessage, ChoiceLogprobs, FunctionCall, TokenLogprob,
                                      ToolCall, UsageInfo, now_s)
from services.gateway.stream_chunks import chat_choice, chunk_head, delta_dict, usage_dict
from services.gateway.streaming import EngineStreams, sse_event


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
            return stream_events(first, streams, self.usage_tally(1), events_of,
                                 usage_event if include_usage else None, opening)

        def response(outputs) -> JSONResponse:
            states = [ChoiceState() for _ in range(req.n)]
            usage = self.usage_tally(1)
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
