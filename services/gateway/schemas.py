"""Request bodies and responses of the OpenAI-compatible API, in OpenAI's shapes.

Request models forbid unknown fields, so a misspelt parameter is a 400 that names it instead of
being silently ignored. Fields of OpenAI's API that pagoda does not implement are declared, so
that a request using them gets a clear refusal (see `request_params`), not an "extra field"
error.
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
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class StructuredOutputsField(RequestModel):
    """vLLM's `structured_outputs`: the grammar the output must follow (exactly one kind)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ExtraSamplingFields(RequestModel):
    """vLLM's sampling parameters beyond OpenAI's, accepted by both endpoints."""
    structured_outputs: StructuredOutputsField | None = None
    allowed_token_ids: list[NonNegativeInt] | None = None
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
    # The prompt's logprobs (the top k per position), its token ids (and each choice's) in the
    # response, and a cut to its last k tokens (-1: max_model_len): see `extensions`.
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    # vLLM fields refused unless they keep their default (extensions.REFUSED_VLLM_FIELDS).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_embeds: Any = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    priority: int = 0
    return_tokens_as_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache already held


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details (vLLM's flag); null without it, as vLLM sends it.
    prompt_tokens_details: PromptTokensDetails | None = None


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
    response_format: ResponseFormat | None = None  # as vLLM, on completions too


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


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(BaseModel):
    """An earlier assistant turn's tool call, sent back in the conversation."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(BaseModel):
    # Messages carry fields pagoda does not use (refusal, audio, ...): they are ignored.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = Field(default=None, validate_default=True)
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None

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


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


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
    response_format: ResponseFormat | None = None
    # Tool calling (see chat_tools): "auto" reads calls out of free text with the server's
    # --tool-call-parser; "required" and a named function constrain the output by a grammar.
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template fields.
    echo: bool = False  # the reply starts with the last message's content (same role only)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    chat_template: str | None = None  # this request's own Jinja template
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the <think> span, with a --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


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
    reasoning_content: str | None = None
    # OpenAI's tool call pieces: {index, id, type, function: {name, arguments}}, the first
    # piece of a call with its id and name, later ones with more of its arguments.
    tool_calls: list[dict[str, Any]] | None = None


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
    root: str | None = None  # vLLM's: the model the name serves (its path)
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
