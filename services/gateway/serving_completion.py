"""`/v1/completions`: prompts (text or token ids, several per request) -> engine requests;
their outputs -> a completion response or its stream chunks."""
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from shared.outputs import CompletionOutput, RequestOutput
from services.gateway.api_errors import APIError
from services.gateway.extensions import (best_of_order, echo_logprobs, prompt_options,
                                         sampled_logprob_sum, vllm_prompt_logprobs)
from services.gateway.openai_serving import (ChoiceState, OpenAIServing, completion_logprobs,
                                             stream_events)
from services.gateway.request_params import completion_prompts, completion_sampling_params
from services.gateway.schemas import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                      CompletionResponse, CompletionStreamResponse, UsageInfo,
                                      now_s)
from services.gateway.stream_chunks import CompletionDelta, chunk_head, usage_dict
from services.gateway.streaming import EngineStreams, sse_event


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

            return stream_events(first, streams, self.usage_tally(len(prompts)), events_of,
                                 usage_event if include_usage else None)

        def response(outputs) -> JSONResponse:
            states = [ChoiceState() for _ in range(len(prompts) * samples)]
            usage = self.usage_tally(len(prompts))
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
