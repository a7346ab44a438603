"""vLLM's chat template fields through the stack (add_generation_prompt, continue_final_message,
chat_template, chat_template_kwargs, echo) and the reasoning split (--reasoning-parser qwen3 in
tests/api/conftest.py STACK_ENV)."""
import json

import openai
import pytest

from shared.chat_template import load_chat_template, render_chat
from shared.tokenizer import get_tokenizer
from tests.api.conftest import MODEL

GREEDY = {"model": MODEL, "temperature": 0}
COUNTING = [{"role": "user", "content": "Count from one to ten."},
            {"role": "assistant", "content": "One, two, three,"}]


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(None)


def _prompt_ids(tokenizer, messages, **options) -> list[int]:
    """The prompt as the stack's tokenizers render it (the same function, template)."""
    from proto.requests import ChatOptions
    return render_chat(tokenizer, messages, ChatOptions(**options),
                       load_chat_template("hermes_tools")).token_ids


def test_add_generation_prompt_false_leaves_out_the_assistant_header(client, tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    on = client.chat.completions.create(messages=messages, max_tokens=1, **GREEDY)
    off = client.chat.completions.create(messages=messages, max_tokens=1,
                                         extra_body={"add_generation_prompt": False}, **GREEDY)
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert on.usage.prompt_tokens - off.usage.prompt_tokens == len(header)
    assert off.usage.prompt_tokens == len(_prompt_ids(tokenizer, messages,
                                                      add_generation_prompt=False))


def test_continue_final_message_continues_the_assistants_text(client, tokenizer):
    """The reply goes on from inside the last message: the same greedy text as a completion of
    that prompt, with no new assistant turn opened."""
    chat = client.chat.completions.create(
        messages=COUNTING, max_tokens=8,
        extra_body={"add_generation_prompt": False, "continue_final_message": True}, **GREEDY)
    ids = _prompt_ids(tokenizer, COUNTING, add_generation_prompt=False,
                      continue_final_message=True)
    assert tokenizer.decode(ids).endswith("One, two, three,")
    completion = client.completions.create(prompt=ids, max_tokens=8, **GREEDY)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == completion.choices[0].text


def test_echo_prepends_the_last_message(client):
    body = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(messages=COUNTING, max_tokens=6, extra_body=body,
                                           **GREEDY)
    echoed = client.chat.completions.create(messages=COUNTING, max_tokens=6,
                                            extra_body={**body, "echo": True}, **GREEDY)
    assert echoed.choices[0].message.content == (
        COUNTING[-1]["content"] + plain.choices[0].message.content)
    stream = client.chat.completions.create(messages=COUNTING, max_tokens=6, stream=True,
                                            extra_body={**body, "echo": True}, **GREEDY)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == echoed.choices[0].message.content


def test_chat_template_and_its_kwargs(client, tokenizer):
    """A request's own template, fed a variable by chat_template_kwargs: the prompt is what that
    template renders, and without the variable it is shorter by just the variable's text."""
    from proto.requests import ChatOptions
    template = ("{{ preamble }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "Name a colour."}]
    preamble = "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
    r = client.chat.completions.create(
        messages=messages, max_tokens=2,
        extra_body={"chat_template": template, "chat_template_kwargs": {"preamble": preamble}},
        **GREEDY)
    rendered = render_chat(tokenizer, messages, ChatOptions(
        chat_template=template, chat_template_kwargs=json.dumps({"preamble": preamble})))
    assert rendered.text.startswith(preamble + "<|im_start|>user\nName a colour.")
    assert r.usage.prompt_tokens == len(rendered.token_ids)
    bare = client.chat.completions.create(messages=messages, max_tokens=2,
                                          extra_body={"chat_template": template}, **GREEDY)
    assert bare.usage.prompt_tokens == r.usage.prompt_tokens - len(
        tokenizer.encode(preamble, add_special_tokens=False))


@pytest.mark.parametrize("body,param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "chat_template"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
], ids=["both", "broken-template", "reserved-kwarg"])
def test_bad_template_fields_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=COUNTING, max_tokens=2, extra_body=body,
                                       **GREEDY)
    assert e.value.body["param"] == param


# One earlier turn that thinks first: the model then writes a <think> span of its own.
THINKING = [{"role": "system", "content": "Think first inside <think></think> tags, then answer."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>2 plus 2 makes 4.</think>4"},
            {"role": "user", "content": "What is 3+5?"}]


def _reasoning(part) -> str | None:
    """reasoning_content of a message or delta (an extra field of the openai client's)."""
    return getattr(part, "reasoning_content", None) or (part.model_extra or {}).get(
        "reasoning_content")


def test_reasoning_is_split_from_the_content(client):
    r = client.chat.completions.create(messages=THINKING, max_tokens=24, **GREEDY)
    message = r.choices[0].message
    reasoning = _reasoning(message)
    assert reasoning and message.content
    assert "think>" not in message.content and "think>" not in reasoning
    stream = client.chat.completions.create(messages=THINKING, max_tokens=24, stream=True,
                                            **GREEDY)
    streamed_reasoning = streamed_content = ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        streamed_reasoning += _reasoning(delta) or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
