"""What every tool-call parser shares: the calls' types, whole-text extraction and streaming.

A parser only says how its model lays calls out in text (`ToolParser.split`): the text outside
the calls, and each call region's JSON. Both entry points then run on that one split: `extract`
on a whole output, `ToolCallStream` on a stream's deltas, so that a streamed response's calls
reassemble to the non-streamed ones.
"""
import json
import uuid
from dataclasses import dataclass, field

from services.gateway.tool_parsers.json_calls import scan_calls


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object's JSON text
    id: str = field(default_factory=new_call_id)

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A stream's piece of call `index`: its first piece has the id and name."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        function = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        d = {"index": self.index, "function": function}
        if self.id is not None:
            d.update(id=self.id, type="function")
        return d


@dataclass
class ParsedText:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def hold_back(text: str, marker: str) -> str:
    """`text` without an end that may be the start of `marker` (more text may complete it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


class ToolParser:
    """Reads tool calls out of a model's text. Subclasses define `split`."""
    name = ""
    # Where a call's arguments may be: llama 3 writes "parameters", most others "arguments".
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    # The calls open with a special token, which the detokenizer must not drop.
    needs_special_tokens = False

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        """The text outside the calls and each call region's JSON text. Unless `final`, the
        content leaves out an end that may still open a call."""
        raise NotImplementedError

    def extract(self, text: str, max_calls: int | None = None) -> ParsedText:
        """A whole output's calls and content. Text that does not read as well-formed calls is
        returned as content, as the model wrote it."""
        content, regions = self.split(text, final=True)
        calls = []
        for region in regions:
            found, ok = scan_calls(region, self.argument_keys)
            if not ok or not found:
                return ParsedText(text)
            for call in found:
                arguments = "{}" if call.arguments is None else call.arguments
                if not call.closed or call.name is None or not _is_json_object(arguments):
                    return ParsedText(text)
                calls.append(ToolCall(call.name, arguments))
        if max_calls is not None:
            calls = calls[:max_calls]
        return ParsedText(content if content.strip() else None, calls)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ToolCallStream:
    """One choice's stream through a parser: `feed` each new piece of text, `finish` at the
    end; each returns the content and call pieces that are new."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = ""
        self.sent_arguments: list[int] = []  # per call: how much of its arguments was sent
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def feed(self, delta: str) -> ParsedDelta:
        self.text += delta
        return self._update(final=False)

    def finish(self) -> ParsedDelta:
        return self._update(final=True)

    def _update(self, final: bool) -> ParsedDelta:
        content, regions = self.parser.split(self.text, final)
        calls = []
        for region in regions:
            calls += scan_calls(region, self.parser.argument_keys)[0]
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        out = ParsedDelta()
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls are sent in order; this one's name is still being written
            arguments = call.arguments or ""
            if final and call.arguments is None:
                arguments = "{}"
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(len(arguments))
                out.tool_calls.append(ToolCallDelta(index, self.ids[index], call.name, arguments))
            elif len(arguments) > self.sent_arguments[index]:
                out.tool_calls.append(ToolCallDelta(
                    index, arguments=arguments[self.sent_arguments[index]:]))
                self.sent_arguments[index] = len(arguments)
        if regions and not self.ids:
            # Until a call is read, a region may turn out not to be calls, and then the whole
            # text is content (`extract`): only what is also the start of the text goes out.
            if final:
                whole = self.parser.extract(self.text, self.max_calls)
                if not whole.tool_calls:
                    content = whole.content or ""
            if content != self.text:
                content = content[:_common_prefix(content, self.text)]
        # Content that is only whitespace (between calls, say) is held until more comes.
        if content.strip() and len(content) > len(self.sent_content):
            out.content = content[len(self.sent_content):]
            self.sent_content = content
        return out


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
