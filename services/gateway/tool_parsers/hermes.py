"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5,
SmolLM2; pagoda's hermes_tools template). A region may also hold a JSON array of calls."""
from services.gateway.tool_parsers.base import ToolParser, hold_back

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        content, regions, i = [], [], 0
        while True:
            start = text.find(START, i)
            if start < 0:
                content.append(text[i:] if final else hold_back(text[i:], START))
                break
            content.append(text[i:start])
            body_start = start + len(START)
            end = text.find(END, body_start)
            if end < 0:  # still being written (or cut off by max_tokens)
                body = text[body_start:]
                regions.append(body if final else hold_back(body, END))
                break
            regions.append(text[body_start:end])
            i = end + len(END)
        return "".join(content), regions
