"""`mistral`: `[TOOL_CALLS]` then a JSON array of calls (Mistral's v3 tokenizer format; the
marker is a special token there, so the detokenizer keeps special tokens for these requests)."""
from services.gateway.tool_parsers.base import ToolParser, hold_back

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        at = text.find(MARKER)
        if at < 0:
            return (text if final else hold_back(text, MARKER)), []
        return text[:at], [text[at + len(MARKER):]]
