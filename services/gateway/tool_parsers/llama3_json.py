"""`llama3_json`: Llama 3.x's JSON calls: the whole output is `{"name": ..., "parameters": {...}}`
(or several, separated by `;`), optionally after `<|python_tag|>`. An output that does not start
with one is plain content."""
from services.gateway.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif not final and PYTHON_TAG.startswith(body):
            return "", []  # only whitespace or the tag's start so far: undecided
        if body.startswith("{"):
            return "", [body]
        if not final and not body:
            return "", []
        return text, []
