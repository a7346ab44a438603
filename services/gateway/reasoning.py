"""Reasoning parsers (vLLM's `--reasoning-parser` names): a model's `<think>...</think>` span
goes to `reasoning_content`, the rest to `content`.

`qwen3`: reasoning only inside an explicit `<think>...</think>` (an output without one is all
content). `deepseek_r1`: the output starts inside the reasoning (the template opened it; a
leading `<think>` is dropped) and it ends at `</think>`; without one, it is all reasoning.
Either way only the first span is reasoning: text after `</think>` is content.
"""
from dataclasses import dataclass

from services.gateway.tool_parsers.base import hold_back

START, END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's text split as it streams: `feed` each new piece, `finish` at the end."""

    def __init__(self, starts_inside: bool):
        # before: may still open a span; inside: reasoning; after: content only.
        self.state = "inside" if starts_inside else "before"
        self.drop_start = starts_inside  # an explicit <think> at the very start is dropped
        self.pending = ""

    def feed(self, text: str) -> ReasoningDelta:
        self.pending += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while self.pending:
            if self.drop_start:
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending = head[len(START):]
                elif not final and START.startswith(head):
                    break  # may still be the tag
                self.drop_start = False
                continue
            if self.state == "after":
                out.content += self.pending
                self.pending = ""
                break
            marker = START if self.state == "before" else END
            at = self.pending.find(marker)
            if at < 0:
                safe = self.pending if final else hold_back(self.pending, marker)
                self._emit(out, safe)
                self.pending = self.pending[len(safe):]
                break
            self._emit(out, self.pending[:at])
            self.pending = self.pending[at + len(marker):]
            self.state = "inside" if self.state == "before" else "after"
        return out

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self.state == "inside":
            out.reasoning += text
        else:
            out.content += text


class ReasoningParser:
    name = ""
    starts_inside = False

    def stream(self, starts_inside: bool | None = None) -> ReasoningStream:
        """`starts_inside`: the prompt already opened a span (a continued final message that
        ends inside `<think>`); None: the parser's own rule."""
        return ReasoningStream(self.starts_inside if starts_inside is None else starts_inside)

    def extract(self, text: str, starts_inside: bool | None = None
                ) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        stream = self.stream(starts_inside)
        first, last = stream.feed(text), stream.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        return reasoning or None, content or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


def opens_reasoning(text: str) -> bool:
    """Whether `text` (a continued final message) ends inside a `<think>` span."""
    return text.rfind(START) > text.rfind(END)
