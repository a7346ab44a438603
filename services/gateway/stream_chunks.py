"""Stream chunks built as plain dicts, once per token, without a pydantic model per chunk.

Each dict has the JSON that the schemas' `model_dump` gives for the same chunk
(`CompletionStreamResponse`, `ChatCompletionChunk`): declared fields in their order, a model's
extra fields (vLLM's) after them. Only a chunk's logprobs still go through their models.
"""
from dataclasses import dataclass, field

from shared.outputs import RequestOutput
from services.gateway.chat_tools import MessageParts
from services.gateway.schemas import ChoiceLogprobs, CompletionLogprobs, TokenLogprob


def chunk_head(response_id: str, kind: str, created: int, model: str) -> dict:
    """The fields every chunk of a stream starts with; `kind` is the chunk's `object`."""
    return {"id": response_id, "object": kind, "created": created, "model": model}


def usage_dict(out: RequestOutput, with_output: bool = True) -> dict:
    """`extensions.usage_so_far` as a dict: one engine request's usage up to this output."""
    p = out.num_prompt_tokens or 0
    c = (out.num_output_tokens or 0) if with_output else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": None}


@dataclass
class CompletionDelta:
    """What one output adds to a completion choice (a `CompletionChoice`'s fields)."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    extras: dict = field(default_factory=dict)  # vLLM's fields (token ids, the prompt's parts)

    def to_dict(self) -> dict:
        return {"index": self.index, "text": self.text,
                "logprobs": None if self.logprobs is None else self.logprobs.model_dump(),
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason,
                **self.extras}


def delta_dict(parts: MessageParts) -> dict | None:
    """A chat stream's new message parts as a delta without its unset fields; None when there
    are none."""
    if parts.content is None and parts.reasoning_content is None and not parts.tool_calls:
        return None
    delta = {}
    if parts.content is not None:
        delta["content"] = parts.content
    if parts.reasoning_content is not None:
        delta["reasoning_content"] = parts.reasoning_content
    if parts.tool_calls:
        delta["tool_calls"] = [c.to_dict() for c in parts.tool_calls]
    return delta


def chat_choice(index: int, delta: dict, logprobs: list[TokenLogprob] | None = None,
                finish_reason: str | None = None, stop_reason: int | str | None = None,
                **extras) -> dict:
    """A `ChatCompletionStreamChoice` as a dict; `delta` from `delta_dict` (or {})."""
    return {"index": index, "delta": delta,
            "logprobs": ChoiceLogprobs(content=logprobs).model_dump() if logprobs else None,
            "finish_reason": finish_reason, "stop_reason": stop_reason, **extras}
