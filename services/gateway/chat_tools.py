"""What a chat completion adds to plain generation: the prompt's template options and tools
on the way in, and on the way out the model's text split into `reasoning_content`, `content`
and `tool_calls`, whole or as a stream.

tool_choice, with `tools` given:
  auto      the server's --tool-call-parser reads calls out of the model's free text
  none      no calls are read (the tools are still shown to the template)
  required  the output is constrained to a JSON array of {"name", "parameters"} items
  named     the output is constrained to that function's arguments object
The constrained choices go through `SamplingParams.structured_outputs` (the worker's grammar).
"""
import dataclasses
import json
from dataclasses import dataclass

from proto.requests import ChatMessage, ChatOptions, ChatPrompt
from services.gateway.reasoning import ReasoningParser, get_reasoning_parser, opens_reasoning
from services.gateway.schemas import ChatCompletionRequest, NamedToolChoice
from services.gateway.tool_parsers import (ParsedDelta, ToolCall, ToolCallDelta, ToolCallStream,
                                           ToolParser, get_tool_parser, new_call_id)
from shared.sampling_params import SamplingParams
from shared.structured_output import StructuredOutputsParams


UNTRUSTED_TEMPLATE = ("a request's own chat template is refused by this server (start it with "
                      "--trust-request-chat-template to allow it)")


class ChatRequestError(ValueError):
    """A chat request's tool or template fields that cannot be served; becomes a 400."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class ChatSettings:
    """The server's chat flags (--tool-call-parser, --reasoning-parser); "" or None: none."""
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # A request's own chat_template is Jinja run by the gateway and the tokenizers: only
    # from clients the operator trusts with that (--trust-request-chat-template).
    trust_request_chat_template: bool = False

    def __post_init__(self):
        # Unknown names fail here, at start-up, not at the first request.
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)


# -- request -> prompt -----------------------------------------------------------------------
def chat_prompt(req: ChatCompletionRequest, settings: ChatSettings) -> ChatPrompt:
    if req.chat_template is not None and not settings.trust_request_chat_template:
        raise ChatRequestError("chat_template", UNTRUSTED_TEMPLATE)
    if req.add_generation_prompt and req.continue_final_message:
        raise ChatRequestError("continue_final_message", "cannot be true together with "
                               "add_generation_prompt (set add_generation_prompt to false)")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise ChatRequestError("continue_final_message", "the last message must be the "
                               "assistant's, to be continued")
    messages = []
    for m in req.messages:
        calls = None
        if m.tool_calls:
            calls = json.dumps([c.model_dump() for c in m.tool_calls])
        messages.append(ChatMessage(m.role, m.text(), calls, m.tool_call_id, m.name))
    options = ChatOptions(
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message, chat_template=req.chat_template,
        chat_template_kwargs=(json.dumps(req.chat_template_kwargs)
                              if req.chat_template_kwargs else None),
        tools=(json.dumps([t.model_dump(exclude_none=True) for t in req.tools])
               if req.tools else None))
    return ChatPrompt(messages, options)


# -- request -> what the output must be -------------------------------------------------------
@dataclass
class ToolPlan:
    mode: str  # "off" (no tools or tool_choice none), "auto", "required", "named"
    parser: ToolParser | None = None  # auto: the server's; required: the grammar's array
    function: str | None = None  # named: the function
    max_calls: int | None = None  # 1 when parallel_tool_calls is false
    schema: dict | None = None  # required / named: the JSON schema the output must follow


class _RequiredCalls(ToolParser):
    """The output `tool_choice: required` constrains: a JSON array of {name, parameters}."""
    name = "required"
    argument_keys = ("parameters",)

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        return "", [text]


def tool_plan(req: ChatCompletionRequest, settings: ChatSettings) -> ToolPlan:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ChatRequestError("tool_choice", "needs `tools`")
        return ToolPlan("off")
    max_calls = 1 if req.parallel_tool_calls is False else None
    functions = {t.function.name: t.function for t in req.tools}
    if choice == "none":
        return ToolPlan("off")
    if isinstance(choice, NamedToolChoice):
        function = functions.get(choice.function.name)
        if function is None:
            raise ChatRequestError("tool_choice", f"function {choice.function.name!r} is not "
                                   f"one of `tools` ({', '.join(functions)})")
        return ToolPlan("named", function=function.name, max_calls=1,
                        schema=function.parameters or {"type": "object"})
    if choice == "required":
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [f.name]},
                                 "parameters": f.parameters or {"type": "object"}},
                  "required": ["name", "parameters"]} for f in functions.values()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if max_calls == 1:
            schema["maxItems"] = 1
        return ToolPlan("required", _RequiredCalls(), max_calls=max_calls, schema=schema)
    if not settings.tool_call_parser:  # "auto", given or by default
        raise ChatRequestError("tool_choice", '"auto" needs the server started with '
                               '--tool-call-parser (or use "required", "none" or a named '
                               'function)')
    return ToolPlan("auto", get_tool_parser(settings.tool_call_parser), max_calls=max_calls)


def with_tool_grammar(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The sampling parameters with the grammar that `required` / named choices need."""
    if plan.schema is None:
        if plan.parser is not None and plan.parser.needs_special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params
    if params.structured_outputs is not None:
        raise ChatRequestError("tool_choice", "a required or named tool choice cannot be "
                               "combined with another output format (response_format)")
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
        json=json.dumps(plan.schema)))


# -- model text -> message fields --------------------------------------------------------------
@dataclass
class MessageParts:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list = dataclasses.field(default_factory=list)  # ToolCall or ToolCallDelta


class ChatOutput:
    """How one request's choices are read: its tool plan, the server's reasoning parser, and
    the echo of the last message."""

    def __init__(self, req: ChatCompletionRequest, plan: ToolPlan, settings: ChatSettings):
        self.plan = plan
        last = req.messages[-1]
        # vLLM's echo: the last message's content, when it is the reply's role.
        self.echo = last.text() if req.echo and last.role == "assistant" else ""
        self.reasoning: ReasoningParser | None = None
        self.starts_inside: bool | None = None
        # A grammar (a tool choice's, or response_format / structured_outputs) holds the output
        # from its first token, so it has no reasoning span: with deepseek_r1, which starts
        # inside one, all of it would otherwise be taken for reasoning.
        fmt = req.response_format
        constrained = (plan.schema is not None or req.structured_outputs is not None
                       or (fmt is not None and fmt.type != "text"))
        if settings.reasoning_parser and not constrained:
            self.reasoning = get_reasoning_parser(settings.reasoning_parser)
            if req.continue_final_message and opens_reasoning(last.text()):
                self.starts_inside = True

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        return "tool_calls" if made_calls and reason == "stop" else reason

    def message(self, text: str) -> MessageParts:
        """A whole choice's text as message fields."""
        plan, out = self.plan, MessageParts()
        if plan.mode == "named":
            out.tool_calls = [ToolCall(plan.function, text)]
            return out
        if self.reasoning is not None:
            out.reasoning_content, text = self.reasoning.extract(text, self.starts_inside)
            text = text or ""
        if plan.parser is not None:
            parsed = plan.parser.extract(text, plan.max_calls)
            out.tool_calls, text = parsed.tool_calls, parsed.content or ""
        text = self.echo + text
        out.content = text if text or not (out.tool_calls or out.reasoning_content) else None
        return out

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: each `feed` (and the `finish`) gives the message parts that are
    new; the parts of a whole stream add up to `ChatOutput.message` of its text."""

    def __init__(self, output: ChatOutput):
        self.plan = output.plan
        self.pending_echo = output.echo
        self.reasoning = (output.reasoning.stream(output.starts_inside)
                          if output.reasoning is not None else None)
        self.tools = (ToolCallStream(self.plan.parser, self.plan.max_calls)
                      if self.plan.parser is not None else None)
        self.named_id: str | None = None

    @property
    def made_calls(self) -> bool:
        if self.plan.mode == "named":
            return self.named_id is not None
        return self.tools is not None and self.tools.num_calls > 0

    def opening(self) -> MessageParts | None:
        """The echo, sent before any output."""
        if not self.pending_echo:
            return None
        parts, self.pending_echo = MessageParts(content=self.pending_echo), ""
        return parts

    def feed(self, text: str, final: bool = False) -> MessageParts:
        out = MessageParts()
        if self.plan.mode == "named":
            if text or (final and self.named_id is None):
                first = self.named_id is None
                self.named_id = self.named_id or new_call_id()
                out.tool_calls = [ToolCallDelta(0, self.named_id if first else None,
                                                self.plan.function if first else None, text)]
            return out
        content = text
        if self.reasoning is not None:
            r = self.reasoning.feed(text)
            if final:
                last = self.reasoning.finish()
                r.reasoning, r.content = r.reasoning + last.reasoning, r.content + last.content
            out.reasoning_content, content = r.reasoning or None, r.content
        if self.tools is not None:
            parsed = self.tools.feed(content)
            if final:
                last = self.tools.finish()
                parsed = ParsedDelta(parsed.content + last.content,
                                     parsed.tool_calls + last.tool_calls)
            content, out.tool_calls = parsed.content, parsed.tool_calls
        out.content = content or None
        return out
