"""Tool-call parsers (services/gateway/tool_parsers): whole-text extraction, and streams cut at
every character boundary that reassemble to the same calls and content."""
import json

import pytest

from services.gateway.tool_parsers import TOOL_PARSERS, ToolCallStream, get_tool_parser
from services.gateway.tool_parsers.json_calls import scan_calls

WEATHER = {"city": "Paris", "units": ["c", "}\"{"], "days": 3}

SAMPLES = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
         + json.dumps(WEATHER) + '}\n</tool_call>',
         "Let me check.\n", [("get_weather", WEATHER)]),
        ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
         '{"arguments": {"x": 1}, "name": "b"}\n</tool_call>',
         None, [("a", {}), ("b", {"x": 1})]),
        # SmolLM2's own layout: one region holding a JSON array of calls.
        ('<tool_call>[{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]'
         '</tool_call>', None, [("a", {"q": "x"}), ("b", {})]),
        ("No tools needed: 4.", "No tools needed: 4.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]",
         None, [("get_weather", WEATHER)]),
        ('Sure [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
         '{"k": null}}]', "Sure ", [("a", {}), ("b", {"k": None})]),
        ("Hello [TOOL", "Hello [TOOL", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
         None, [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}',
         None, [("a", {"n": 1}), ("b", {})]),
        ("The weather is {sunny}.", "The weather is {sunny}.", []),
    ],
}


def _cases():
    for parser, samples in SAMPLES.items():
        for i, sample in enumerate(samples):
            yield pytest.param(parser, *sample, id=f"{parser}-{i}")


def test_every_parser_has_samples():
    assert set(SAMPLES) == set(TOOL_PARSERS) == {"hermes", "mistral", "llama3_json"}


@pytest.mark.parametrize("name,text,content,calls", list(_cases()))
def test_whole_text(name, text, content, calls):
    parsed = get_tool_parser(name).extract(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)
    assert all(c.id.startswith("chatcmpl-tool-") for c in parsed.tool_calls)


def _reassemble(stream: ToolCallStream, pieces) -> tuple[str, list[dict]]:
    content, calls = "", []
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            if c.index == len(calls):  # a call's first piece: its id and name
                assert c.id is not None and c.name is not None
                calls.append({"id": c.id, "name": c.name, "arguments": c.arguments})
            else:
                assert c.index == len(calls) - 1 and c.id is None and c.name is None
                calls[c.index]["arguments"] += c.arguments
    return content, calls


@pytest.mark.parametrize("name,text,content,calls", list(_cases()))
def test_stream_split_at_every_boundary(name, text, content, calls):
    """Two pieces cut at each character, and one character at a time: the same calls and
    content as the whole text."""
    parser = get_tool_parser(name)
    whole = parser.extract(text)
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        got_content, got_calls = _reassemble(ToolCallStream(parser), pieces)
        assert got_content == (whole.content or "")
        assert [(c["name"], c["arguments"]) for c in got_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls]


def test_stream_sends_a_calls_name_before_its_arguments_are_done():
    stream = ToolCallStream(get_tool_parser("hermes"))
    first = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "get_weather", '{"ci')]
    assert first.tool_calls[0].to_dict()["type"] == "function"
    more = stream.feed('ty": "Paris"}}\n</tool_call>')
    assert [d.arguments for d in more.tool_calls] == ['ty": "Paris"}']
    assert more.tool_calls[0].to_dict() == {"index": 0, "function": {"arguments": 'ty": "Paris"}'}}


def test_max_calls_keeps_the_first():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    parser = get_tool_parser("hermes")
    assert [c.name for c in parser.extract(text, max_calls=1).tool_calls] == ["a"]
    _, calls = _reassemble(ToolCallStream(parser, max_calls=1), list(text))
    assert [c["name"] for c in calls] == ["a"]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "a", "arguments": {"x": 1</tool_call>',  # arguments cut off
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    "<tool_call>get_weather(city='Paris')</tool_call>",  # not JSON
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
])
def test_malformed_calls_stay_content(text):
    parsed = get_tool_parser("hermes").extract(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_arguments_written_as_a_json_string():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
    [call] = get_tool_parser("hermes").extract(text).tool_calls
    assert json.loads(call.arguments) == {"x": 1}


def test_scan_reports_partial_calls():
    calls, ok = scan_calls('[{"name": "a", "parameters": {"k": "v"}}, {"name": "b", "param')
    assert ok and [(c.name, c.arguments, c.closed) for c in calls] == [
        ("a", '{"k": "v"}', True), ("b", None, False)]
    assert scan_calls("hello")[1] is False


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name,text", [
    ("hermes", 'Sure <tool_call>not json</tool_call> done'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("llama3_json", '{"answer": 42, "unit": "m"}'),
    ("mistral", "[TOOL_CALLS] not a list of calls"),
])
def test_malformed_calls_stay_content_when_streamed(name, text):
    """What the whole text gives as content (no calls) is what the stream sends, not the text
    outside the would-be call regions, or nothing."""
    parser = get_tool_parser(name)
    whole = parser.extract(text)
    assert whole.tool_calls == [] and whole.content == text
    for pieces in ([text[:k], text[k:]] for k in range(len(text) + 1)):
        assert _reassemble(ToolCallStream(parser), pieces) == (text, [])
    assert _reassemble(ToolCallStream(parser), list(text)) == (text, [])
