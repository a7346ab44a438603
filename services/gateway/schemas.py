"""Request bodies and responses of the OpenAI-compatible API, in OpenAI's shapes.

Request models forbid unknown fields, so a misspelt parameter is a 400 that names it instead of
being silently ignored. Fields of OpenAI's API that pagoda does not implement are declared, so
that a request using them gets a clear refusal (see `openai_serving`), not an "extra field" error.
Beyond OpenAI's fields, both requests take vLLM's extra sampling parameters (`top_k`, `min_p`, ...).
"""
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationInfo,
                      field_validator)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors ---------------------------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(ResponseModel):
    error: ErrorInfo


# -- shared pieces --------------------------------------------------------------------------------
class StreamOptions(RequestModel):
    include_usage: bool = False


class ExtraSamplingFields(RequestModel):
    """vLLM's sampling parameters beyond OpenAI's, accepted by both endpoints."""
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class ExtraRequestFields(ExtraSamplingFields):
    """vLLM's request fields that are not sampling parameters, accepted by both endpoints."""
    # Requests share prefix-cache blocks only with requests of the same salt (one per tenant
    # keeps tenants' prompts apart).
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# -- /v1/completions ------------------------------------------------------------------------------
TokenIds = list[NonNegativeInt]


class CompletionRequest(ExtraRequestFields):
    model: str | None = None
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: PositiveInt | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # OpenAI fields pagoda refuses unless they keep their default meaning.
    best_of: PositiveInt | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's extra: the stop string or stop token id that ended the completion.
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions -------------------------------------------------------------------------
class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(BaseModel):
    # Messages carry fields pagoda does not use (name, tool_call_id, ...): they are ignored.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_required(cls, content, info: ValidationInfo):
        # As OpenAI: only an assistant message (one that called tools) may come without content.
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs its content")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(ExtraRequestFields):
    model: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # OpenAI fields pagoda refuses unless they keep their default meaning.
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None


class ChatMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# -- /v1/models -----------------------------------------------------------------------------------
class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "pagoda"
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
