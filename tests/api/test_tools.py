"""Tool calling through the stack and the official openai client (the stack serves the
hermes_tools template with --tool-call-parser hermes: tests/api/conftest.py STACK_ENV).

The default model (SmolLM2-135M-Instruct) calls a tool on its own, greedy, once the conversation
shows it one earlier call (ONE_SHOT); from the tool list alone it answers in prose.
"""
import json

import openai
import pytest

from tests.api.conftest import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def _earlier_call(city: str, call_id: str = "call_1") -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


ONE_SHOT = [{"role": "user", "content": "What is the weather in Berlin?"}, _earlier_call("Berlin"),
            {"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 40}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def whole(api_stack):
    """Non-streamed ONE_SHOT replies by tool_choice, each asked once for the module's tests."""
    from tests.api.conftest import API_KEY
    client = openai.OpenAI(base_url=api_stack.gateway_url + "/v1", api_key=API_KEY,
                           max_retries=0, timeout=120)
    replies = {}

    def reply(tool_choice):
        key = json.dumps(tool_choice)
        if key not in replies:
            replies[key] = client.chat.completions.create(
                messages=ONE_SHOT, tools=TOOLS, tool_choice=tool_choice, **GREEDY).choices[0]
        return replies[key]
    return reply


def _check_arguments(arguments: str, tool: dict) -> dict:
    """The arguments parse as JSON and follow the function's parameters schema (its types,
    required keys, bounds and no others)."""
    args = json.loads(arguments)
    schema = tool["function"]["parameters"]
    assert isinstance(args, dict)
    assert set(schema["required"]) <= set(args) <= set(schema["properties"])
    for key, value in args.items():
        prop = schema["properties"][key]
        if prop["type"] == "string":
            assert isinstance(value, str) and len(value) <= prop["maxLength"]
        else:
            assert isinstance(value, int) and prop["minimum"] <= value <= prop["maximum"]
    return args


def _reassemble(stream) -> tuple[list[dict], str, str | None]:
    """Streamed tool-call deltas -> calls (OpenAI's shape: a call's first piece has its index,
    id, type and name), the streamed content and the finish reason."""
    calls, content, finish = [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index == len(calls):
                assert d.id and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name,
                              "arguments": d.function.arguments or ""})
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    return calls, content, finish


def test_named_tool_call_follows_the_functions_schema(whole):
    choice = whole(NAMED)
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-")
    _check_arguments(call.function.arguments, WEATHER)
    assert choice.finish_reason == "tool_calls"


def test_required_returns_tool_calls(client):
    r = client.chat.completions.create(
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, **GREEDY)
    choice = r.choices[0]
    [call] = choice.message.tool_calls  # parallel_tool_calls=false: one call
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    _check_arguments(call.function.arguments, tool)
    assert choice.finish_reason == "tool_calls"


def test_auto_calls_a_tool_when_the_prompt_calls_for_one(whole):
    choice = whole("auto")
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert _check_arguments(call.function.arguments, WEATHER)["city"] == "Paris"
    assert choice.message.content is None  # the call was all of the reply


def test_none_returns_no_tool_calls(whole):
    """The same prompt as under auto: its <tool_call> text stays content."""
    choice = whole("none")
    assert not choice.message.tool_calls
    assert choice.finish_reason != "tool_calls"
    assert "get_weather" in choice.message.content


def test_a_tool_result_turn_is_accepted(client):
    """The tool's result reaches the prompt: a longer result, a longer prompt."""
    def ask(result: str):
        return client.chat.completions.create(
            messages=[ONE_SHOT[0], _earlier_call("Berlin", "call_7"),
                      {"role": "tool", "tool_call_id": "call_7", "content": result}],
            tools=TOOLS, model=MODEL, temperature=0, max_tokens=4)
    short, longer = ask('{"celsius": 20}'), ask('{"celsius": 20, "sky": "clear", "wind": 3}')
    assert short.choices[0].message.content and short.choices[0].finish_reason == "length"
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens


@pytest.mark.parametrize("tool_choice", ["auto", NAMED], ids=["auto", "named"])
def test_streamed_tool_calls_reassemble_to_the_whole_response(client, whole, tool_choice):
    """Greedy, the same request streamed and not: the deltas add up to the same calls."""
    expected = whole(tool_choice)
    calls, content, finish = _reassemble(client.chat.completions.create(
        messages=ONE_SHOT, tools=TOOLS, tool_choice=tool_choice, stream=True, **GREEDY))
    assert expected.message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in expected.message.tool_calls]
    assert content == (expected.message.content or "")
    assert finish == expected.finish_reason == "tool_calls"


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
], ids=["unknown-function", "bad-choice", "bad-name"])
def test_bad_tool_fields_are_a_400_naming_the_field(client, fields, param):
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=ONE_SHOT, **GREEDY, **body)
    assert e.value.body["param"].startswith(param)
