"""The stream chunks that services/gateway/stream_chunks.py builds as dicts are the chunks the
pydantic schemas dump (services/gateway/schemas.py): the same JSON, fields in the same order.
Each case builds one chunk both ways, as the gateway composes it and as the schema models do,
the reference's chat delta without its unset (None) fields."""
import json

import pytest
from openai.types.chat import ChatCompletionChunk as OpenAIChatChunk

from shared.outputs import CompletionOutput, RequestOutput
from services.gateway.chat_tools import MessageParts
from services.gateway.openai_serving import chat_logprobs, completion_logprobs
from services.gateway.schemas import (ChatCompletionChunk, ChatCompletionStreamChoice,
                                      ChoiceLogprobs, CompletionChoice, CompletionStreamResponse,
                                      DeltaMessage, UsageInfo)
from services.gateway.stream_chunks import (CompletionDelta, chat_choice, chunk_head, delta_dict,
                                            usage_dict)
from services.gateway.streaming import sse_event
from services.gateway.tool_parsers.base import ToolCallDelta

HEAD = {"id": "cmpl-abc", "created": 1_700_000_000, "model": "smol"}
CHAT_HEAD = {**HEAD, "id": "chatcmpl-abc"}


def _output(with_logprobs: bool, finish_reason: str | None = None) -> RequestOutput:
    """One step's output of two tokens (with their top-2 logprobs when asked)."""
    logprobs = texts = None
    if with_logprobs:
        logprobs = [{5: -0.25, 9: -1.75}, {6: -0.5, 2: -1.0}]
        texts = [{5: "Hel", 9: "He"}, {6: "lo é", 2: "l"}]
    c = CompletionOutput(0, "Hello é", [5, 6], None, logprobs, finish_reason,
                         None if finish_reason is None else 2, texts)
    return RequestOutput("r-0", None, [], None, [c], finish_reason is not None,
                         num_prompt_tokens=7, num_output_tokens=4)


def _same(ours: dict, reference: dict) -> None:
    """Equal as JSON, and written alike (the same text: the same field order)."""
    assert json.loads(json.dumps(ours)) == json.loads(json.dumps(reference))
    assert sse_event(ours) == sse_event(reference)


def _schema_chat_chunk(model: ChatCompletionChunk, include_usage: bool) -> dict:
    """A chat chunk as the schemas dump it: `usage` only when the client asked for usage, a
    delta without its unset fields."""
    data = model.model_dump(exclude=None if include_usage else {"usage"})
    for choice in data["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return data


# -- /v1/completions ----------------------------------------------------------------------------
@pytest.mark.parametrize("with_logprobs", [False, True], ids=["text", "logprobs"])
@pytest.mark.parametrize("usage", ["none", "final", "continuous"])
def test_a_completion_text_delta_is_the_schema_chunk(with_logprobs, usage):
    out = _output(with_logprobs)
    c = out.outputs[0]
    logprobs = completion_logprobs(c, 3)[0] if with_logprobs else None
    if with_logprobs:
        assert logprobs.tokens == ["Hel", "lo é"] and logprobs.text_offset == [3, 6]
    ours = {**chunk_head(HEAD["id"], "text_completion", HEAD["created"], HEAD["model"]),
            "choices": [CompletionDelta(0, c.text, logprobs).to_dict()]}
    if usage != "none":
        ours["usage"] = usage_dict(out) if usage == "continuous" else None
    reference = CompletionStreamResponse(
        **HEAD, choices=[CompletionChoice(index=0, text=c.text, logprobs=logprobs)],
        usage=UsageInfo(prompt_tokens=7, completion_tokens=4, total_tokens=11)
        if usage == "continuous" else None).model_dump(
            exclude=None if usage != "none" else {"usage"})
    _same(ours, reference)


def test_a_completion_delta_with_vllms_fields_and_its_end_is_the_schema_chunk():
    out = _output(False, finish_reason="stop")
    c = out.outputs[0]
    extras = {"prompt_token_ids": [1, 2, 3], "token_ids": list(c.token_ids),
              "prompt_logprobs": [None, {"2": {"logprob": -1.5, "rank": 1,
                                               "decoded_token": "x"}}]}
    ours = {**chunk_head(HEAD["id"], "text_completion", HEAD["created"], HEAD["model"]),
            "choices": [CompletionDelta(3, c.text, None, c.finish_reason, c.stop_reason,
                                        extras).to_dict()]}
    reference = CompletionStreamResponse(**HEAD, choices=[CompletionChoice(
        index=3, text=c.text, finish_reason="stop", stop_reason=2, **extras)]).model_dump(
            exclude={"usage"})
    _same(ours, reference)
    # vLLM's fields come after the declared ones, in the order given.
    assert list(ours["choices"][0])[-3:] == list(extras)


# -- /v1/chat/completions -----------------------------------------------------------------------
NO_USAGE = object()  # the client did not ask for usage: no `usage` field at all


def _chat_chunk(choice: dict, usage=NO_USAGE, **parts) -> dict:
    """As the gateway's chat stream composes a chunk (serving_chat.ChatServing): `usage` a
    `usage_dict` or None."""
    data = {**chunk_head(CHAT_HEAD["id"], "chat.completion.chunk", CHAT_HEAD["created"],
                         CHAT_HEAD["model"]), "choices": [choice]}
    if usage is not NO_USAGE:
        data["usage"] = usage
    data.update(parts)  # vLLM's fields, after the declared ones
    return data


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("with_logprobs", [False, True], ids=["text", "logprobs"])
def test_a_chat_content_delta_is_the_schema_chunk(with_logprobs, include_usage):
    out = _output(with_logprobs)
    c = out.outputs[0]
    logprobs = chat_logprobs(c, 2) if with_logprobs else None
    ours = _chat_chunk(chat_choice(0, delta_dict(MessageParts(content=c.text)), logprobs),
                       usage_dict(out) if include_usage else NO_USAGE)
    reference = _schema_chat_chunk(ChatCompletionChunk(**CHAT_HEAD, choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content=c.text),
                                   logprobs=ChoiceLogprobs(content=logprobs)
                                   if logprobs else None)],
        usage=UsageInfo(prompt_tokens=7, completion_tokens=4, total_tokens=11)
        if include_usage else None), include_usage)
    _same(ours, reference)
    if with_logprobs:
        assert ours["choices"][0]["logprobs"]["content"][1]["token"] == "lo é"


def test_the_opening_chunk_with_the_prompts_token_ids_is_the_schema_chunk():
    out = _output(False)
    opening = _chat_chunk(chat_choice(0, {"role": "assistant", "content": ""}),
                          usage_dict(out, with_output=False), prompt_token_ids=[1, 2, 3])
    reference = _schema_chat_chunk(ChatCompletionChunk(
        **CHAT_HEAD, choices=[ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(role="assistant", content=""))],
        usage=UsageInfo(prompt_tokens=7, completion_tokens=0, total_tokens=7),
        prompt_token_ids=[1, 2, 3]), include_usage=True)
    _same(opening, reference)
    assert list(opening)[-1] == "prompt_token_ids"  # after the declared fields


def test_a_chat_reasoning_delta_is_the_schema_chunk():
    ours = _chat_chunk(chat_choice(0, delta_dict(MessageParts(
        reasoning_content="Let me think", content="Sure"))))
    reference = _schema_chat_chunk(ChatCompletionChunk(**CHAT_HEAD, choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(
            content="Sure", reasoning_content="Let me think"))]), False)
    _same(ours, reference)
    only = _chat_chunk(chat_choice(0, delta_dict(MessageParts(reasoning_content="hm"))))
    assert only["choices"][0]["delta"] == {"reasoning_content": "hm"}


def test_a_chat_tool_call_delta_is_the_schema_chunk_in_openais_shape():
    first = ToolCallDelta(0, "call_1", "get_weather", "")
    more = ToolCallDelta(0, None, None, '{"city": "Paris"}')
    # OpenAI's pieces of a streamed call: the first with its id, type and name.
    pieces = [{"index": 0, "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": ""}},
              {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]
    for call, piece, finish in ((first, pieces[0], None), (more, pieces[1], "tool_calls")):
        ours = _chat_chunk(chat_choice(0, delta_dict(MessageParts(tool_calls=[call])),
                                       finish_reason=finish))
        reference = _schema_chat_chunk(ChatCompletionChunk(**CHAT_HEAD, choices=[
            ChatCompletionStreamChoice(index=0, delta=DeltaMessage(tool_calls=[piece]),
                                       finish_reason=finish)]), False)
        # The pieces are plain dicts in the schema too: equal as JSON (their own key order).
        assert json.loads(json.dumps(ours)) == json.loads(json.dumps(reference))
        # And the official client reads the piece.
        parsed = OpenAIChatChunk.model_validate(ours)
        tool_call = parsed.choices[0].delta.tool_calls[0]
        assert (tool_call.index, tool_call.id, tool_call.function.arguments) == (
            0, call.id, call.arguments)
        assert tool_call.function.name == call.name


def test_a_chat_delta_with_vllms_token_ids_and_its_end_is_the_schema_chunk():
    out = _output(False, finish_reason="stop")
    c = out.outputs[0]
    ours = _chat_chunk(chat_choice(1, delta_dict(MessageParts(content=c.text)), None, "stop",
                                   2, token_ids=list(c.token_ids)), usage_dict(out))
    reference = _schema_chat_chunk(ChatCompletionChunk(**CHAT_HEAD, choices=[
        ChatCompletionStreamChoice(index=1, delta=DeltaMessage(content=c.text),
                                   finish_reason="stop", stop_reason=2,
                                   token_ids=list(c.token_ids))],
        usage=UsageInfo(prompt_tokens=7, completion_tokens=4, total_tokens=11)), True)
    _same(ours, reference)
    # A delta with nothing new is none at all; an empty one is {}, as the schema's.
    assert delta_dict(MessageParts()) is None
    empty = _chat_chunk(chat_choice(0, {}, None, "stop"))
    _same(empty, _schema_chat_chunk(ChatCompletionChunk(**CHAT_HEAD, choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop")]),
        False))


def test_usage_tally_sums_prompts_and_reports_cached_tokens_only_when_asked():
    from services.gateway.openai_serving import UsageTally

    def out(prompt: int, output: int, cached: int = 0) -> RequestOutput:
        o = RequestOutput("r", None, [], None, [], False, num_cached_tokens=cached)
        o.num_prompt_tokens, o.num_output_tokens = prompt, output
        return o
    for details in (False, True):
        tally = UsageTally(2, details)
        tally.add(0, out(40, 1, cached=32))  # a request's first output carries its hit
        tally.add(1, out(20, 1, cached=16))
        tally.add(0, out(40, 3))  # later ones do not: the hit stays
        info = tally.info()
        assert (info.prompt_tokens, info.completion_tokens, info.total_tokens) == (60, 4, 64)
        if details:
            assert info.prompt_tokens_details.cached_tokens == 48
        else:
            assert info.prompt_tokens_details is None
            assert info.model_dump()["prompt_tokens_details"] is None  # null, as vLLM sends it
