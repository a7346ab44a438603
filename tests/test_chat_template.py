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


def test_a_requests_own_template_is_refused_unless_the_server_trusts_its_clients():
    """The gateway's check (pure: no stack), before any Jinja runs."""
    from services.gateway.chat_tools import ChatRequestError, ChatSettings, chat_prompt
    from services.gateway.schemas import ChatCompletionRequest
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                chat_template="{{ messages[0].content }}")
    with pytest.raises(ChatRequestError, match="^chat_template: .*--trust-request-chat-template"):
        chat_prompt(req, ChatSettings())
    prompt = chat_prompt(req, ChatSettings(trust_request_chat_template=True))
    assert prompt.options.chat_template == "{{ messages[0].content }}"


def test_boolean_settings_read_from_the_environment(monkeypatch):
    from shared.stack_config import StackConfig
    for text, value in [("true", True), ("1", True), ("false", False), ("0", False)]:
        monkeypatch.setenv("PAGODA_TRUST_REQUEST_CHAT_TEMPLATE", text)
        assert StackConfig(run_dir="/tmp/x").trust_request_chat_template is value
    monkeypatch.setenv("PAGODA_TRUST_REQUEST_CHAT_TEMPLATE", "maybe")
    with pytest.raises(ValueError, match="not a boolean"):
        StackConfig(run_dir="/tmp/x")


def test_boolean_settings_as_flags_stand_alone_or_take_a_value():
    # `--enable-prompt-tokens-details` alone, as vLLM takes it, or with a value; unset (None),
    # the environment or the default decides.
    import argparse

    from shared.stack_config import StackConfig
    parser = StackConfig.add_cli_args(argparse.ArgumentParser())
    for argv, value in [([], None), (["--enable-prompt-tokens-details"], True),
                        (["--enable-prompt-tokens-details", "false"], False),
                        (["--enable-prompt-tokens-details", "1"], True)]:
        assert parser.parse_args(argv).enable_prompt_tokens_details is value
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-prompt-tokens-details", "maybe"])


def test_a_boolean_flag_wins_over_the_environment_even_when_it_gives_the_default(monkeypatch):
    import argparse

    from shared.stack_config import StackConfig
    monkeypatch.setenv("PAGODA_ENABLE_PROMPT_TOKENS_DETAILS", "true")
    monkeypatch.setenv("PAGODA_RUN_DIR", "/tmp/x")
    parser = StackConfig.add_cli_args(argparse.ArgumentParser())
    read = lambda argv: StackConfig.from_cli_args(parser.parse_args(argv))  # noqa: E731
    assert read([]).enable_prompt_tokens_details is True  # the environment's
    assert read(["--enable-prompt-tokens-details", "false"]).enable_prompt_tokens_details is False


def test_a_replica_flag_picks_that_replicas_addresses_over_the_environments_replica(monkeypatch):
    import argparse

    from shared.stack_config import StackConfig
    monkeypatch.setenv("PAGODA_REPLICA", "1")
    monkeypatch.setenv("PAGODA_RUN_DIR", "/tmp/x")
    monkeypatch.setenv("PAGODA_ENGINE_INPUT", "tcp://e0:1,tcp://e1:1")
    parser = StackConfig.add_cli_args(argparse.ArgumentParser())
    stack = StackConfig.from_cli_args(parser.parse_args(["--replica", "0"]))
    assert (stack.replica, stack.engine_input) == (0, "tcp://e0:1")
    stack = StackConfig.from_cli_args(parser.parse_args([]))
    assert (stack.replica, stack.engine_input) == (1, "tcp://e1:1")
