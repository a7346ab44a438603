"""Chat conversations -> prompt text and token ids, with a HF tokenizer's Jinja chat template.

The one place where a chat template is applied: the tokenizer service renders chat requests
with `render_chat`, and anything that must show the same prompt (a /tokenize endpoint) calls it
too. Errors are `ChatTemplateError`s whose message starts with the request field they blame.
"""
import json
import os
from dataclasses import dataclass

from proto.requests import ChatMessage, ChatOptions

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")

# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered as asked; the message starts with the field."""


@dataclass
class RenderedChat:
    text: str
    token_ids: list[int]


def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value as template text: a file's path, the name of a template shipped
    in shared/templates (`hermes_tools`), or the template's Jinja text itself. None or "": none
    (the tokenizer's own template is used)."""
    if not value:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    shipped = os.path.join(TEMPLATE_DIR, value + ".jinja")
    if os.sep not in value and os.path.isfile(shipped):
        with open(shipped, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a file, a shipped template "
                     f"({', '.join(shipped_templates())}) nor Jinja text")


def shipped_templates() -> list[str]:
    if not os.path.isdir(TEMPLATE_DIR):
        return []
    return sorted(n[:-len(".jinja")] for n in os.listdir(TEMPLATE_DIR) if n.endswith(".jinja"))


def _json_field(text: str | None, field: str, kind: type):
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ChatTemplateError(f"{field}: not valid JSON: {e}") from None
    if not isinstance(value, kind):
        raise ChatTemplateError(f"{field}: must be a JSON {kind.__name__}")
    return value


def message_dict(m: ChatMessage | dict, index: int = 0) -> dict:
    """A message as chat templates read it: OpenAI's shape, with each tool call's `arguments`
    parsed into an object (templates write them out with `tojson`)."""
    if isinstance(m, dict):
        d = dict(m)
        calls = d.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ChatTemplateError(f"messages[{index}].tool_calls: must be a list")
    else:
        d = {"role": m.role, "content": m.content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        calls = _json_field(m.tool_calls, f"messages[{index}].tool_calls", list)
    if calls:
        d["tool_calls"] = [_parsed_arguments(c) for c in calls]
    return d


def _parsed_arguments(call) -> dict:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError:
            pass  # the template gets the text as the client sent it
    return {**call, "function": function}


def render_chat(tokenizer, messages: list[ChatMessage] | list[dict],
                options: ChatOptions | None = None,
                default_template: str | None = None) -> RenderedChat:
    """The prompt of a chat request. Template: the request's own (`options.chat_template`), else
    `default_template` (the service's --chat-template), else the tokenizer's."""
    options = options or ChatOptions()
    if options.add_generation_prompt and options.continue_final_message:
        raise ChatTemplateError("continue_final_message: cannot be true together with "
                                "add_generation_prompt (set add_generation_prompt to false)")
    conversation = [message_dict(m, i) for i, m in enumerate(messages)]
    if options.continue_final_message and (not conversation
                                           or conversation[-1].get("role") != "assistant"):
        raise ChatTemplateError("continue_final_message: the last message must be the "
                                "assistant's, to be continued")
    tools = _json_field(options.tools, "tools", list)
    extra = _json_field(options.chat_template_kwargs, "chat_template_kwargs", dict) or {}
    reserved = sorted(set(extra) & _RESERVED_KWARGS)
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs: may not set {', '.join(reserved)} "
                                f"(use the request's own fields)")
    template = options.chat_template or default_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("messages: this model has no chat template; serve it with "
                                "--chat-template or send chat_template")
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **extra)
    except Exception as e:  # a template may refuse a conversation (roles, order) or not parse
        field = "chat_template" if options.chat_template else "messages"
        raise ChatTemplateError(f"{field}: the chat template refused them: {e}") from None
    if not isinstance(text, str):
        raise ChatTemplateError("chat_template: the template did not render text")
    # The template already holds any BOS token.
    return RenderedChat(text, tokenizer.encode(text, add_special_tokens=False))
