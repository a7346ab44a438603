"""Reasoning parsers (services/gateway/reasoning.py): <think> spans split off whole and as
streams cut at every character boundary."""
import pytest

from services.gateway.reasoning import REASONING_PARSERS, get_reasoning_parser, opens_reasoning

CASES = [
    ("qwen3", "<think>2 and 2 make 4.</think>The answer is 4.", "2 and 2 make 4.",
     "The answer is 4."),
    ("qwen3", "Plain answer, no thinking.", None, "Plain answer, no thinking."),
    ("qwen3", "<think>cut off by max_tokens", "cut off by max_tokens", None),
    ("qwen3", "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    ("qwen3", "x < y <thin", None, "x < y <thin"),
    ("deepseek_r1", "thinking here</think>answer", "thinking here", "answer"),
    ("deepseek_r1", "<think>thinking</think>answer", "thinking", "answer"),
    ("deepseek_r1", "all reasoning, never closed", "all reasoning, never closed", None),
]


def _streamed(name, pieces, starts_inside=None):
    stream = get_reasoning_parser(name).stream(starts_inside)
    reasoning = content = ""
    for d in [stream.feed(p) for p in pieces] + [stream.finish()]:
        reasoning += d.reasoning
        content += d.content
    return reasoning or None, content or None


def test_names():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_whole_text(name, text, reasoning, content):
    assert get_reasoning_parser(name).extract(text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_stream_split_at_every_boundary(name, text, reasoning, content):
    for k in range(len(text) + 1):
        assert _streamed(name, [text[:k], text[k:]]) == (reasoning, content)
    assert _streamed(name, list(text)) == (reasoning, content)


def test_stream_sends_reasoning_as_it_comes():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<thi").reasoning == ""
    d = stream.feed("nk>one two")
    assert (d.reasoning, d.content) == ("one two", "")
    d = stream.feed(" three</th")  # the closing tag's start is held back
    assert (d.reasoning, d.content) == (" three", "")
    d = stream.feed("ink>done")
    assert (d.reasoning, d.content) == ("", "done")


def test_a_prompt_that_opened_the_span():
    """A continued final message that ends inside <think>: the output starts as reasoning."""
    assert opens_reasoning("<think>Let me see") and not opens_reasoning("<think>a</think>b")
    parser = get_reasoning_parser("qwen3")
    assert parser.extract("so 8.</think>8", starts_inside=True) == ("so 8.", "8")
    assert _streamed("qwen3", list("so 8.</think>8"), starts_inside=True) == ("so 8.", "8")


@pytest.mark.parametrize("fmt", [{"response_format": {"type": "json_object"}},
                                 {"structured_outputs": {"regex": "[a-z]+"}}])
def test_a_constrained_output_is_all_content(fmt):
    """Under a grammar the output has no <think> span: deepseek_r1, which starts inside one,
    must not take the whole (JSON) output for reasoning."""
    from services.gateway.chat_tools import ChatOutput, ChatSettings, tool_plan
    from services.gateway.schemas import ChatCompletionRequest
    settings = ChatSettings(reasoning_parser="deepseek_r1")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fmt)
    parts = ChatOutput(req, tool_plan(req, settings), settings).message('{"a": 1}')
    assert (parts.reasoning_content, parts.content) == (None, '{"a": 1}')
    free = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    parts = ChatOutput(free, tool_plan(free, settings), settings).message("think</think>ok")
    assert (parts.reasoning_content, parts.content) == ("think", "ok")
