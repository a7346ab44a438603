"""LLMEngine: requests in, `step()` = schedule -> execute -> process outputs (seed §3)."""
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass

import structlog

from proto.messages import ExecuteModelRequest, SamplerOutput
from proto.requests import ResumedOutput
from shared.config import PagodaConfig
from shared.engine_args import EngineArgs
from shared.incremental_detokenizer import IncrementalDetokenizer
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from shared.structured_output import check_supported
from shared.tokenizer import eos_token_ids, get_tokenizer
from services.engine.executor import Executor
from services.engine.in_flight import may_submit, must_collect
from services.engine.request_output import build_request_output
from services.engine.resume import resume_outputs
from services.engine.scheduler import ScheduledSequenceGroup, Scheduler, SchedulerOutputs
from services.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from services.engine.spec_stats import SpecDecodeStats
from services.engine.stop_checker import check_stop

log = structlog.get_logger("engine")

_SPEC_LOG_S = 10.0  # how often the speculative decoding counters are logged, at most


class PromptTooLongError(ValueError):
    pass


class NoKVCacheError(RuntimeError):
    """The workers have no memory left for a KV cache."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: dict
    last_step_tokens: int
    num_steps: int
    total_prompt_tokens: int
    total_generation_tokens: int
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on


class LLMEngine:
    def __init__(self, config: PagodaConfig, executor_class: type[Executor], detokenize: bool = True):
        """`detokenize=False`: the engine service, where tokenizer and detokenizer processes
        handle text (prompts arrive as token ids, stop strings are checked downstream)."""
        self.config = config
        self.model_config = config.model_config
        self.detokenize = detokenize
        self.tokenizer = get_tokenizer(self.model_config.tokenizer) if detokenize else None
        self.eos_token_ids = (eos_token_ids(self.tokenizer, self.model_config.hf_config)
                              if detokenize else [])
        self.executor = executor_class(config)
        num_device_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
        if num_device_blocks <= 0:
            raise NoKVCacheError("no memory left for the KV cache; lower max_num_batched_tokens "
                                 "or raise gpu_memory_utilization / kv_cache_space_gib")
        self.executor.initialize_cache(num_device_blocks, num_cpu_blocks)
        config.cache_config.num_device_blocks = num_device_blocks
        config.cache_config.num_cpu_blocks = num_cpu_blocks
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config,
                                   config.speculative_config)
        spec = config.speculative_config
        self.spec_stats = (SpecDecodeStats(accepted_per_pos=[0] * spec.num_speculative_tokens)
                           if spec is not None else None)
        self._spec_logged_at = time.monotonic()
        self.seq_counter = itertools.count()
        self.step_counter = itertools.count()
        self.rng = random.Random(self.model_config.seed)  # seeds for requests that give none
        self.groups: dict[str, SequenceGroup] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.last_step_tokens = 0
        self.num_steps = 0
        self.in_flight: deque[SchedulerOutputs] = deque()  # step_async's submitted steps
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        config = engine_args.create_engine_config()
        if config.parallel_config.tensor_parallel_size > 1:
            from services.engine.executor.multiproc import TensorParallelExecutor
            return cls(config, TensorParallelExecutor)
        from services.engine.executor.uniproc import UniProcExecutor
        return cls(config, UniProcExecutor)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, sampling_params: SamplingParams,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None,
                    eos_token_ids: list[int] | None = None,
                    cache_salt: str | None = None) -> SequenceGroup:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, "
                            f"got {type(sampling_params).__name__}")
        sampling_params.verify()  # a field may have been changed since it was created
        sampling_params.verify_token_ids(self.model_config.vocab_size)
        if sampling_params.structured_outputs is not None:
            check_supported(sampling_params.structured_outputs)
        sched = self.config.scheduler_config
        if sampling_params.n > min(sched.max_num_seqs, sched.max_num_batched_tokens):
            raise ValueError(f"n={sampling_params.n} samples never fit in one step (max_num_seqs "
                             f"{sched.max_num_seqs}, max_num_batched_tokens "
                             f"{sched.max_num_batched_tokens})")
        if prompt_token_ids is None:
            if prompt is None or self.tokenizer is None:
                raise ValueError("give prompt_token_ids (this engine does not tokenize)"
                                 if prompt is not None else "give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        max_len = self.config.scheduler_config.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model allows at most "
                f"{max_len - 1} prompt tokens (max_model_len {max_len})")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        seed = sampling_params.seed if sampling_params.seed is not None else self.rng.getrandbits(31)
        seq = Sequence(next(self.seq_counter), prompt_token_ids, cache_salt=cache_salt)
        eos = self.eos_token_ids if eos_token_ids is None else eos_token_ids
        group = SequenceGroup(request_id, prompt, prompt_token_ids, sampling_params, seq, seed,
                              eos, arrival_time)
        self.groups[request_id] = group
        self.scheduler.add_seq_group(group)
        return group

    def resume_outputs(self, group: SequenceGroup, resumed: list[ResumedOutput]) -> None:
        """A request that an engine which died had been running, sent again with the output its
        client already has (`resume.resume_outputs`). Call right after `add_request`, before
        the next step is scheduled. Raises ValueError for output that does not fit the
        request."""
        resume_outputs(group, resumed, self.model_config.vocab_size,
                       self.config.scheduler_config.max_model_len,
                       lambda: next(self.seq_counter))

    def abort_request(self, request_id: str | list[str]) -> list[SequenceGroup]:
        aborted = self.scheduler.abort_seq_group(request_id)
        for group in aborted:
            self._forget(group)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One synchronous step: schedule, execute, process. (The engine service overlaps them.)"""
        request, sched = self.schedule_step()
        if request is None:
            groups = self.process_ignored(sched)
        else:
            groups = self.process_model_outputs(sched, self.executor.execute_model(request))
        return [self.request_output(g) for g in groups]

    def step_async(self) -> list[RequestOutput]:
        """One turn of a loop that keeps a step in flight, as the engine service's does: the
        next step is scheduled and submitted while the executor runs the current one, then the
        oldest is read (`--async-scheduling`). Call it while `has_unfinished_requests()` or
        `has_steps_in_flight()`."""
        groups, submitted = [], False
        if may_submit(self.in_flight):
            request, sched = self.schedule_step()
            if request is not None:
                self.executor.submit(request)
                self.in_flight.append(sched)
                submitted = True
            else:
                groups += self.process_ignored(sched)
        if must_collect(self.in_flight, submitted):
            sched = self.in_flight.popleft()
            groups += self.process_model_outputs(sched, self.executor.collect())
        return [self.request_output(g) for g in groups]

    def has_steps_in_flight(self) -> bool:
        return bool(self.in_flight)

    def schedule_step(self) -> tuple[ExecuteModelRequest | None, SchedulerOutputs]:
        """Schedule the next step. Its samples become placeholders in the sequences, so the
        following step can be scheduled before this one's output is read."""
        metadata, sched = self.scheduler.schedule()
        if sched.is_empty():
            return None, sched
        for scheduled in sched.scheduled_seq_groups:
            if scheduled.do_sample:
                self._expect_samples(scheduled)
        request = ExecuteModelRequest(
            step_id=next(self.step_counter), seq_group_metadata_list=metadata,
            blocks_to_swap_in=sched.blocks_to_swap_in, blocks_to_swap_out=sched.blocks_to_swap_out,
            blocks_to_copy=sched.blocks_to_copy, finished_seq_ids=sched.finished_seq_ids,
            num_lookahead_slots=sched.num_lookahead_slots)
        return request, sched

    def _expect_samples(self, scheduled: ScheduledSequenceGroup) -> None:
        group = scheduled.seq_group
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        n = group.sampling_params.n
        if n > 1 and len(group.seqs) == 1 and seqs[0].num_output_tokens == 0:
            # The prompt's last chunk: the worker samples all n first tokens from it. Fork the
            # children now, so that they join the very next step in lockstep with the parent.
            parent = seqs[0]
            for j in range(1, n):
                child = Sequence(next(self.seq_counter), group.prompt_token_ids, sample_index=j,
                                 cache_salt=group.cache_salt)
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                child.parent_seq_id = parent.seq_id
                self.scheduler.fork_seq(parent, child)
                group.seqs.append(child)
                seqs.append(child)
        for seq in seqs:
            seq.append_placeholder()

    def process_ignored(self, sched: SchedulerOutputs) -> list[SequenceGroup]:
        for group in sched.ignored_seq_groups:
            group.error = (f"the request needs more KV cache than this engine has "
                           f"(prompt of {group.prompt_len} tokens)")
            self._forget(group)
        return list(sched.ignored_seq_groups)

    def process_model_outputs(self, sched: SchedulerOutputs,
                              result: SamplerOutput) -> list[SequenceGroup]:
        """Put the step's samples into their sequences and check stops. Returns the groups that
        advanced (finished ones are already forgotten by the engine)."""
        now = time.time()
        updated = self.process_ignored(sched)
        samples: dict[int, list[int]] = {}
        for i, seq_id in enumerate(result.seq_ids):
            samples.setdefault(seq_id, []).append(i)
        prompt_lps = {p.seq_id: p for p in result.prompt_logprobs}
        self.last_step_tokens = sched.num_batched_tokens
        self.num_steps += 1
        for scheduled in sched.scheduled_seq_groups:
            group = scheduled.seq_group
            if self.groups.get(group.request_id) is not group:
                # Aborted or finished while the step was in flight (its id may be in use by a
                # later request already).
                continue
            if group.prompt_logprobs is not None and group.first_seq.seq_id in prompt_lps:
                group.append_prompt_logprobs(prompt_lps[group.first_seq.seq_id])
            if scheduled.is_prompt:
                self.total_prompt_tokens += scheduled.token_chunk_size
            if not scheduled.do_sample:
                continue
            for seq in list(group.seqs):
                idx = samples.get(seq.seq_id)
                if not idx:
                    continue
                if len(idx) > 1:  # a fan-out: sample j belongs to the child with sample_index j
                    by_index = {s.sample_index: s for s in group.seqs}
                    pairs = [(by_index[j], i) for j, i in enumerate(idx)]
                else:
                    pairs = [(seq, idx[0])]
                for target, i in pairs:
                    if not target.is_finished():
                        self._append_sample(group, target, result, i)
            if scheduled.num_lookahead_slots:
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    self._release_lookahead(seq)
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
            updated.append(group)
        self.scheduler.free_finished_seq_groups()
        for group in updated:
            if group.is_finished():
                group.metrics.finished_time = now
                self._forget(group)
        if self.spec_stats is not None and time.monotonic() - self._spec_logged_at > _SPEC_LOG_S:
            self._spec_logged_at = time.monotonic()
            self._spec_stats().log_summary(log)
        return updated

    def _append_sample(self, group: SequenceGroup, seq: Sequence, result: SamplerOutput,
                       i: int) -> None:
        params = group.sampling_params
        token = result.token_ids[i]
        top = None
        if params.logprobs is not None:
            top = dict(zip(result.top_token_ids[i], result.top_logprobs[i]))
            top[token] = result.logprobs[i]
        seq.fill_placeholder(token, result.logprobs[i], top)
        self._check_token(group, seq, token)
        if result.num_proposed and result.num_proposed[i]:
            self.spec_stats.count(result.num_proposed[i], len(result.extra_token_ids[i]))
        extra = result.extra_token_ids[i] if result.extra_token_ids else []
        if extra:
            # No step is scheduled behind a speculative one: nothing is in flight after these.
            assert seq.num_placeholders == 0, f"seq {seq.seq_id}: placeholders after a speculation"
            seq.num_computed_tokens += len(extra)  # accepted proposals: their KV is cached
            for token, logprob in zip(extra, result.extra_logprobs[i]):
                if seq.is_finished():
                    break  # tokens after a stop are dropped
                seq.token_ids.append(token)
                seq.cumulative_logprob += logprob
                self._check_token(group, seq, token)
        if seq.is_finished():
            seq.drop_placeholders()

    def _release_lookahead(self, seq: Sequence) -> None:
        """Free the blocks reserved for rejected proposals; the worker drops the same entries
        of its block table, so what it holds of the table is what is left."""
        bm = self.scheduler.block_manager
        bm.free_lookahead(seq)
        seq.num_blocks_sent = min(seq.num_blocks_sent, len(bm.get_block_table(seq)))

    def _check_token(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        """Count one new output token and check whether it ends the sequence."""
        params = group.sampling_params
        self.total_generation_tokens += 1
        new_text_len = 0
        if params.stop and self.detokenize:
            detok = self.detokenizers.get(seq.seq_id)
            if detok is None:
                detok = self.detokenizers[seq.seq_id] = self._detokenizer(group)
            new_text = detok.decode_incremental([token])
            seq.output_text += new_text
            new_text_len = len(new_text)
        check_stop(seq, params, group.eos_token_ids, self.config.scheduler_config.max_model_len,
                   new_text_len)

    def _detokenizer(self, group: SequenceGroup) -> IncrementalDetokenizer:
        p = group.sampling_params
        return IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids,
                                      p.skip_special_tokens, p.spaces_between_special_tokens)

    # -- outputs -------------------------------------------------------------------------------
    def request_output(self, group: SequenceGroup) -> RequestOutput:
        return build_request_output(group, self.tokenizer)

    def _forget(self, group: SequenceGroup) -> None:
        if self.groups.get(group.request_id) is group:  # not a later request of the same id
            del self.groups[group.request_id]
        for seq in group.seqs:
            self.detokenizers.pop(seq.seq_id, None)

    def recover_from_worker_loss(self) -> int:
        """The workers lost their KV cache and their copy of every sequence (a worker died; the
        caller discards the steps in flight). Every unfinished request is recomputed from the
        tokens the engine has read: samples of discarded steps (placeholders) are dropped, the
        sequences will be sent whole (`reset`), with their parameters. Returns the number of
        requests whose KV cache was lost."""
        for group in self.groups.values():
            group.params_sent = False
            for seq in group.seqs:
                seq.drop_placeholders()
                seq.seen_by_worker = False
                seq.parent_seq_id = -1  # the new worker knows no parent to fork from
            if len(group.seqs) > 1 and all(s.num_output_tokens == 0 for s in group.seqs):
                # Forked for a fan-out sample that never arrived: fork again after the prompt.
                group.seqs = group.seqs[:1]
        return self.scheduler.recompute_all()

    def resize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        """A new worker's cache size; only while nothing holds blocks (after a worker loss)."""
        cache = self.config.cache_config
        cache.num_device_blocks, cache.num_cpu_blocks = num_device_blocks, num_cpu_blocks
        self.scheduler.reset_block_manager()

    def get_stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_swapped=len(s.swapped),
            kv_cache_usage=s.block_manager.usage,
            prefix_cache_hit_rate=s.block_manager.prefix_cache_hit_rate,
            num_preemptions=dict(s.num_preemptions), last_step_tokens=self.last_step_tokens,
            num_steps=self.num_steps, total_prompt_tokens=self.total_prompt_tokens,
            total_generation_tokens=self.total_generation_tokens,
            spec_decode=self._spec_stats())

    def _spec_stats(self) -> SpecDecodeStats | None:
        if self.spec_stats is None:
            return None
        self.spec_stats.num_steps_off = self.scheduler.num_steps_speculation_off
        return self.spec_stats
