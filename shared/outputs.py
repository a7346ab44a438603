"""What the engine returns for a request (vLLM's RequestOutput / CompletionOutput names): the
offline LLM returns these, and the gateway's client builds the same from the stack's messages.
"""
from dataclasses import dataclass, field

@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # For each generated token, {token id: logprob} holding the sampled token and the top
    # `SamplingParams.logprobs` alternatives (None when not asked for).
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Streaming clients only: the text of each token in `logprobs`, {token id: text}.
    logprob_texts: list[dict[int, str]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    # Streaming clients: token counts so far (prompt_token_ids is not sent back over the wire).
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None
    # Streaming clients, with the first output: the text of each token in `prompt_logprobs`,
    # {token id: text} (for the first position, its token's only), and the request's time from
    # arrival to its first schedule.
    prompt_logprob_texts: list[dict[int, str] | None] | None = None
    queue_time_s: float | None = None
