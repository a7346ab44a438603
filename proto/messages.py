"""Messages between the engine and its workers (design §2).

A step's request is a *delta*: the worker caches each sequence (its tokens, block table and
sampling parameters) the first time it is scheduled, and afterwards a step carries only what
changed, so the bytes of one decode step do not grow with sequence length.
"""
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams

# A token id the engine has not read yet (its step is still in flight): the worker has it.
PLACEHOLDER = -1


@dataclass
class SequenceData:
    """One sequence's part of a step, relative to what the worker already holds."""
    seq_id: int
    # Tokens before this position are in the KV cache; this step computes the next
    # `SequenceGroupMetadata.token_chunk_size` tokens from here.
    num_computed_tokens: int
    # Tokens the worker has not seen, appended to its copy of the sequence: the prompt when
    # first scheduled, the whole sequence after `reset`, nothing in a steady decode (the worker
    # appends the tokens it sampled itself).
    new_token_ids: list[int] = field(default_factory=list)
    # Physical block ids appended to the worker's block table (the whole table after `reset`).
    block_ids: list[int] = field(default_factory=list)
    # The worker drops what it held for this sequence (first schedule, resumption after
    # preemption, swap-in) and starts from `new_token_ids` / `block_ids`.
    reset: bool = False
    # A forked child: start from a copy of the parent's prompt tokens, then `new_token_ids`.
    parent_seq_id: int = -1
    # Which of the request's n samples this sequence is: with the request's seed it picks the
    # sequence's random stream, so seeded output does not depend on batch mates.
    sample_index: int = 0


@dataclass
class SequenceGroupMetadata:
    """One request's share of a step (the seed's SequenceGroupMetadata, sent as a delta)."""
    request_id: str
    is_prompt: bool
    seq_data: list[SequenceData]
    token_chunk_size: int  # tokens computed for each sequence in this step
    do_sample: bool = True  # False for a prefill chunk that does not reach the prompt's end
    prompt_len: int = 0
    # Sent the first time the worker sees the request (None afterwards: the worker cached it).
    sampling_params: SamplingParams | None = None
    # Ids that end the request (EOS and stop token ids), masked while min_tokens is not reached;
    # sent with `sampling_params`.
    eos_token_ids: list[int] = field(default_factory=list)
    # Per-request random stream: with the same seed the same tokens come out, whatever the batch;
    # with speculative decoding on, only for the same batches: whether a step speculates (and
    # so which draws a sampled request's tokens come from) depends on how many sequences decode
    # in it (disable_by_batch_size) and on the blocks and token budget left.
    seed: int = 0
    # Speculative decoding: KV slots the engine reserved past this decode's token, so the worker
    # may verify up to this many proposed tokens after it (0: an ordinary step).
    num_lookahead_slots: int = 0


@dataclass
class ExecuteModelRequest:
    step_id: int
    seq_group_metadata_list: list[SequenceGroupMetadata]
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    finished_seq_ids: list[int] = field(default_factory=list)  # the worker drops their state
    # The most proposals any group of this step may verify (speculative decoding; 0: none).
    num_lookahead_slots: int = 0


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens computed in this step, for positions [start, start + len)."""
    seq_id: int
    start: int
    token_logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class SamplerOutput:
    """One step's samples, column-wise: entry i belongs to sequence seq_ids[i].

    A prompt step of a request with n > 1 returns n samples under the parent's seq id; the engine
    forks the sequence and gives sample j to child j.
    """
    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each sampled token
    # Top alternatives, for samples whose request asked (`SamplingParams.logprobs`), else empty.
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # The forward pass and sampling, measured in the worker: its time launching the step and
    # reading the samples back (on a GPU, the wait for them; not time queued behind a step).
    model_time_s: float = 0.0
    # Speculative steps only (else empty), per entry: the tokens that follow token_ids[i] in
    # this step (accepted proposals, then the target's own token), their raw logprobs, and how
    # many tokens were proposed (accepted ones = len(extra_token_ids[i]), when any).
    extra_token_ids: list[list[int]] = field(default_factory=list)
    extra_logprobs: list[list[float]] = field(default_factory=list)
    num_proposed: list[int] = field(default_factory=list)
