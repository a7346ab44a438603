"""Messages between the gateway, tokenizers, the engine and detokenizers (design §2).

Plain dataclasses; `proto.codec` turns each into a compact msgpack array. Token ids and logprobs
are plain lists here and packed arrays on the wire. Per-step messages (`TokenDeltas`,
`TextDeltas`) carry every request that advanced in the step, so a step costs one frame, not one
per request.
"""
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


@dataclass
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool" | ...
    content: str  # a message's text parts, joined
    # What chat templates need of tool use, as OpenAI's API names it. Nested values travel as
    # JSON text (the codec carries flat values only).
    tool_calls: str | None = None  # assistant: its calls, OpenAI's JSON array of tool calls
    tool_call_id: str | None = None  # tool: the call this message answers
    name: str | None = None  # tool: the function's name


@dataclass
class ChatOptions:
    """How the tokenizer renders a chat request's messages (vLLM's chat request fields)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last (assistant) message
    chat_template: str | None = None  # the request's own Jinja template, instead of the served one
    chat_template_kwargs: str | None = None  # JSON object text: extra variables for the template
    tools: str | None = None  # JSON array text of OpenAI tool objects, given to the template


@dataclass
class ChatPrompt:
    """A chat prompt with its options, as the gateway hands it to its engine client, which
    sends them as `GenerateRequest.prompt` and `.chat_options`. Not a wire message itself."""
    messages: list[ChatMessage]
    options: ChatOptions = field(default_factory=ChatOptions)


@dataclass
class ResumedOutput:
    """What a client already holds of one sequence of a request whose engine died: the new
    engine recomputes these tokens as output (not prompt) and samples on from there."""
    index: int  # which of the request's n samples
    token_ids: list[int]
    finished: bool = False  # the client has this sample's end; it is not run again


@dataclass
class PromptOptions:
    """What a request asks of its prompt beyond the text (vLLM's request fields)."""
    # Keep only the prompt's last k tokens (-1: the last max_model_len); None keeps all.
    truncate_prompt_tokens: int | None = None
    # The client wants the prompt's token ids back with the first output.
    return_prompt_token_ids: bool = False


@dataclass
class GenerateRequest:
    """gateway → tokenizer: a request as the client gave it."""
    request_id: str
    # The gateway that holds the client's stream: outputs are routed back to it by this id.
    gateway_id: str
    # Text (completions), token ids (completions with a pre-tokenized prompt) or chat messages
    # (the tokenizer applies the chat template).
    prompt: str | list[int] | list[ChatMessage]
    sampling_params: SamplingParams
    arrival_time: float  # time.time() when the gateway received it, for latency metrics
    # Prefix-cache namespace: requests share cached KV blocks only when their salts are equal
    # (None shares with every other request without one).
    cache_salt: str | None = None
    # Sent again after an engine restart: the output the client has already streamed.
    resumed: list[ResumedOutput] = field(default_factory=list)
    chat_options: ChatOptions | None = None  # chat prompts only (None: the defaults)
    prompt_options: PromptOptions | None = None  # None: the defaults
    # The engine replica the client bound the request to (data parallelism): the tokenizer
    # pushes the EngineRequest to that replica's engine input.
    replica: int = 0


@dataclass
class EngineRequest:
    """tokenizer → engine: a checked, tokenized request, ready to schedule."""
    request_id: str
    gateway_id: str
    prompt: str | None  # the prompt text, when there was one (for logs and echo)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The tokenizer knows the model's end-of-sequence ids; the engine checks token ids only.
    eos_token_ids: list[int]
    arrival_time: float
    cache_salt: str | None = None
    resumed: list[ResumedOutput] = field(default_factory=list)  # see GenerateRequest
    return_prompt_token_ids: bool = False  # see GenerateRequest


@dataclass
class AbortRequest:
    """gateway → engine: stop these requests (client gone, timeout) and free their blocks."""
    request_ids: list[str]
    reason: str


@dataclass
class FinishRequest:
    """detokenizer → engine: these requests hit a stop string; finish them and free their blocks."""
    request_ids: list[str]
    reason: str


@dataclass
class SequenceTokenDelta:
    """What one of a request's n sequences produced in a step."""
    index: int  # which of the request's n samples
    token_ids: list[int]  # new tokens this step
    # Only when the request asked for logprobs; else empty, which costs a few bytes.
    logprobs: list[float] = field(default_factory=list)  # of each new token
    top_token_ids: list[list[int]] = field(default_factory=list)  # per new token
    top_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while it runs
    stop_reason: int | str | None = None  # the stop token id (or string) that finished it
    num_output_tokens: int = 0  # generated so far, including this step's


@dataclass
class PromptDelta:
    """The prompt's part of a request's first delta, when the client asked for it (its token
    ids, or prompt logprobs). Logprobs are of positions 1.. (the first token has none), laid
    out as `SequenceTokenDelta`'s; the token texts are filled in by the detokenizer."""
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    top_token_texts: list[list[str]] = field(default_factory=list)


@dataclass
class RequestTokenDelta:
    request_id: str
    gateway_id: str  # the detokenizer forwards the text to this gateway
    num_prompt_tokens: int
    sequences: list[SequenceTokenDelta]
    # The first delta of a request (and any delta after a detokenizer restart) carries what the
    # detokenizer needs to start: the request's parameters and the prompt's last tokens (context
    # for the first word's spacing). Later deltas leave them empty.
    sampling_params: SamplingParams | None = None
    prompt_tail_token_ids: list[int] = field(default_factory=list)
    prompt: PromptDelta | None = None  # with a header, when the request asked for it
    # With a header: seconds from the request's arrival to its first schedule, and how many
    # of its prompt tokens the prefix cache held then.
    queue_time_s: float | None = None
    num_cached_tokens: int | None = None


@dataclass
class TokenDeltas:
    """engine → detokenizer: every request that advanced in one step."""
    step_id: int
    requests: list[RequestTokenDelta] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int  # over all n sequences, as the OpenAI API counts it


@dataclass
class SequenceTextDelta:
    """What one sequence adds to the client's stream."""
    index: int
    text: str  # new text since the last delta, stop strings already cut
    token_ids: list[int]
    # Only when the request asked for logprobs: per new token its text, its logprob and its top
    # alternatives; texts come from the detokenizer so the gateway needs no tokenizer.
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_token_texts: list[list[str]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Where this delta starts in the sequence's whole output: characters of text and tokens
    # before it. A detokenizer that takes over a request (its first one died) decodes the
    # output again from the start; the client drops what it already has by these offsets.
    text_offset: int = 0
    token_offset: int = 0


@dataclass
class RequestTextDelta:
    request_id: str
    sequences: list[SequenceTextDelta]
    usage: Usage
    prompt: PromptDelta | None = None  # see RequestTokenDelta
    queue_time_s: float | None = None
    num_cached_tokens: int | None = None


@dataclass
class TextDeltas:
    """detokenizer → gateway: the text of every request of this gateway that advanced in a step."""
    requests: list[RequestTextDelta] = field(default_factory=list)


@dataclass
class RequestAccepted:
    """engine → client: these requests are in the engine. Until a request is acknowledged
    (by this or by any output or error of it) the client resends it, so a request that a dying
    tokenizer had taken is not lost; the engine ignores a copy of a request it already has."""
    request_ids: list[str]


@dataclass
class ErrorResponse:
    """Sent back to a requester when its request cannot be served (bad prompt, too long, ...)."""
    request_id: str | None  # None when the frame was too broken to read a request id from it
    code: int  # HTTP status the gateway answers with: 400 bad request, 413, 429, 500, ...
    message: str


@dataclass
class HealthRequest:
    """Asked on a service's control socket; the answer is a `HealthResponse`."""


@dataclass
class HealthResponse:
    service: str  # "engine", "tokenizer", ...
    status: str  # "ok" | "starting" | "degraded"
    # Flat values only, so any monitoring page can show them as they are.
    details: dict[str, str | int | float | bool | None] = field(default_factory=dict)
