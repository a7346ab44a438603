"""Tool-call parsers by vLLM's `--tool-call-parser` names."""
from services.gateway.tool_parsers.base import (ParsedDelta, ParsedText, ToolCall, ToolCallDelta,
                                                ToolCallStream, ToolParser, new_call_id)
from services.gateway.tool_parsers.hermes import HermesToolParser
from services.gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from services.gateway.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "get_tool_parser", "ParsedDelta", "ParsedText", "ToolCall",
           "ToolCallDelta", "ToolCallStream", "ToolParser", "new_call_id"]
