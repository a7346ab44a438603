"""Sequences and sequence groups: the engine's state of each request (never crosses a socket)."""
import enum
import time

from proto.messages import PLACEHOLDER
from services.engine.block_hash import check_cache_salt
from shared.outputs import RequestMetrics
from shared.sampling_params import SamplingParams




class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                SequenceStatus.FINISHED_ABORTED: "abort"}.get(self)


class Sequence:
    """One sequence of tokens: the prompt and what has been generated after it."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sample_index: int = 0,
                 cache_salt: str | None = None):
        self.seq_id = seq_id
        # The request's prefix-cache namespace: only sequences with an equal salt (or none) share
        # cached blocks. Forks of a request must be given the same one.
        self.cache_salt = check_cache_salt(cache_salt)
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.sample_index = sample_index
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or scheduled to be)
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []  # per output token, when asked
        self.output_text = ""
        self.stop_reason: int | str | None = None
        # What the worker holds of this sequence: see proto.SequenceData.
        self.worker_synced = False  # the worker has this sequence's tokens
        self.num_blocks_sent = 0  # block table entries the worker has
        # The worker has held state for it at some point (a preempted sequence's stays there):
        # it must be told to drop it when the sequence ends.
        self.seen_by_worker = False
        self.released = False  # its blocks are freed and the worker told, exactly once
        self.parent_seq_id = -1  # set on a fork until the worker has seen the child
        # Tokens scheduled to be sampled whose values the engine has not read yet (the step is in
        # flight); they sit at the end of `token_ids` as PLACEHOLDER.
        self.num_placeholders = 0
        self.num_emitted = 0  # output tokens already sent downstream (engine service)

    def __len__(self) -> int:
        """Tokens including in-flight placeholders: what the KV cache will hold."""
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_placeholders

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_known_tokens - self.prompt_len

    @property
    def last_token_id(self) -> int:
        return self.token_ids[self.num_known_tokens - 1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_placeholder(self) -> None:
        self.token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def fill_placeholder(self, token_id: int, logprob: float, top: dict[int, float] | None) -> None:
        """The oldest in-flight sample arrived: put its token in place."""
        assert self.num_placeholders > 0, f"seq {self.seq_id}: a sample nobody scheduled"
        self.token_ids[len(self.token_ids) - self.num_placeholders] = token_id
        self.num_placeholders -= 1
        self.cumulative_logprob += logprob
        if top is not None:
            self.output_logprobs.append(top)

    def drop_placeholders(self) -> None:
        """A finished sequence keeps only the tokens it really generated."""
        if self.num_placeholders:
            del self.token_ids[len(self.token_ids) - self.num_placeholders:]
            self.num_placeholders = 0

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: the KV cache is gone, the tokens stay."""
        self.num_computed_tokens = 0
        self.worker_synced = False
        self.num_blocks_sent = 0


class SequenceGroup:
    """One request: its sequences (n > 1 forks more after the prompt), parameters and timing."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, first_seq: Sequence, seed: int,
                 eos_token_ids: list[int], arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.seqs: list[Sequence] = [first_seq]
        self.seed = seed
        self.eos_token_ids = eos_token_ids
        self.metrics = RequestMetrics(
            arrival_time=time.time() if arrival_time is None else arrival_time)
        self.params_sent = False  # the worker has this request's sampling parameters
        self.error: str | None = None  # why the engine could not serve it, if it could not
        self.header_sent = False  # the detokenizer has this request's parameters
        # Prompt tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens: int | None = None
        self.return_prompt_token_ids = False  # the client wants them with the first output
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)

    @property
    def first_seq(self) -> Sequence:
        return self.seqs[0]

    @property
    def cache_salt(self) -> str | None:
        return self.first_seq.cache_salt

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status == status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished()]

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs)

    def max_num_running_seqs(self) -> int:
        """Sequences this group runs: n from the prompt's last chunk on (the worker samples n first
        tokens from it), fewer as samples finish."""
        if len(self.seqs) == 1 and self.first_seq.num_output_tokens == 0:
            return self.sampling_params.n
        return len(self.unfinished_seqs())

    def is_prefill(self) -> bool:
        return any(s.num_uncomputed_tokens > 1 for s in self.unfinished_seqs()) or (
            self.first_seq.num_computed_tokens < self.prompt_len)

    def append_prompt_logprobs(self, plp) -> None:
        """Record a step's prompt logprobs (a `PromptLogprobs` of the step's output): each
        position's top entries and its own token's, once (a prompt recomputed after a
        preemption brings positions already recorded)."""
        for k, pos in enumerate(range(plp.start, plp.start + len(plp.token_logprobs))):
            if pos < len(self.prompt_logprobs):
                continue
            assert pos == len(self.prompt_logprobs), f"prompt logprobs skip position {pos}"
            entry = dict(zip(plp.top_token_ids[k], plp.top_logprobs[k]))
            entry[self.prompt_token_ids[pos]] = plp.token_logprobs[k]
            self.prompt_logprobs.append(entry)
