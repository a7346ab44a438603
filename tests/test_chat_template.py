"""shared/chat_template.py without a model: what render_chat refuses before any template runs."""
import pytest

from shared.chat_template import ChatTemplateError, render_chat


class _NoTemplate:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, *args, **kwargs):
        raise AssertionError("not reached")


@pytest.mark.parametrize("calls", [5, "call", {"id": "x"}])
def test_tool_calls_that_are_not_a_list_are_the_clients_error(calls):
    """/tokenize passes messages as dicts: a malformed tool_calls is a ChatTemplateError (a
    400 naming the field), not a TypeError."""
    with pytest.raises(ChatTemplateError, match=r"^messages\[1\]\.tool_calls"):
        render_chat(_NoTemplate(), [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "", "tool_calls": calls}])
