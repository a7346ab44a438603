"""Scheduler: waiting / running / swapped queues, continuous batching under a token budget.

Each step it picks, in order: the running groups (decodes and unfinished prompt chunks, FCFS),
swapped groups that fit back in, then waiting groups (FCFS) while the budget lasts. When blocks
run out it preempts the group that arrived last (recompute by default, or swap). It returns one
`SequenceGroupMetadata` per scheduled group as a delta against what the worker already holds.
"""
import time
from collections import deque
from dataclasses import dataclass, field

from proto.messages import SequenceData, SequenceGroupMetadata
from shared.config import CacheConfig, SchedulerConfig
from shared.speculative import SpeculativeConfig, may_speculate
from services.engine.block_manager import AllocStatus, BlockManager
from services.engine.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class ScheduledSequenceGroup:
    seq_group: SequenceGroup
    token_chunk_size: int  # tokens computed for each of its running sequences
    is_prompt: bool
    do_sample: bool
    # Speculative decoding: KV slots reserved past the decode's token for proposals to verify.
    num_lookahead_slots: int = 0


@dataclass
class SchedulerOutputs:
    scheduled_seq_groups: list[ScheduledSequenceGroup] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_groups: int = 0
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    ignored_seq_groups: list[SequenceGroup] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    num_preempted: int = 0
    num_lookahead_slots: int = 0  # the most any group has this step (0: it does not speculate)

    def is_empty(self) -> bool:
        return not self.scheduled_seq_groups and not self.blocks_to_swap_out


class _Budget:
    def __init__(self, max_tokens: int):
        self.tokens_left = max_tokens


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 speculative_config: SpeculativeConfig | None = None):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.speculative_config = speculative_config
        self.num_steps_speculation_off = 0  # steps with too many decodes to speculate
        self.block_manager = self._new_block_manager()
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self._finished_seq_ids: list[int] = []  # the worker is told to drop these next step

    def reset_block_manager(self) -> None:
        """An empty block manager sized by `cache_config` (a new worker's cache); only while no
        sequence holds blocks."""
        assert not self.running and not self.swapped, "sequences still hold blocks"
        self.block_manager = self._new_block_manager()

    def _new_block_manager(self) -> BlockManager:
        cache = self.cache_config
        return BlockManager(block_size=cache.block_size, num_device_blocks=cache.num_device_blocks,
                            num_cpu_blocks=cache.num_cpu_blocks or 0,
                            enable_prefix_caching=cache.enable_prefix_caching)

    # -- requests ------------------------------------------------------------------------------
    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_ids: str | list[str]) -> list[SequenceGroup]:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in ids]:
                queue.remove(group)
                for seq in group.unfinished_seqs():
                    self._free_seq(seq)
                    seq.status = SequenceStatus.FINISHED_ABORTED
                aborted.append(group)
        return aborted

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def free_finished_seq_groups(self) -> None:
        for group in self.running:
            for seq in group.seqs:
                if seq.is_finished() and not seq.released:
                    self._free_seq(seq)
        self.running = [g for g in self.running if not g.is_finished()]

    def _free_seq(self, seq: Sequence) -> None:
        if seq.released:
            return
        self.block_manager.free(seq)  # a no-op for a sequence that holds no blocks
        seq.released = True
        if seq.seen_by_worker:
            self._finished_seq_ids.append(seq.seq_id)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        out = SchedulerOutputs()
        budget = _Budget(self.config.max_num_batched_tokens)
        now = time.time()
        preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget, now)
        if self.speculative_config is not None:
            self._reserve_lookahead(out, budget)
        if not out.is_empty():  # else they wait for the next step that reaches the worker
            out.finished_seq_ids = self._finished_seq_ids
            self._finished_seq_ids = []
        metadata = [self._metadata(s) for s in out.scheduled_seq_groups]
        # Advance only now: the metadata carries each sequence's position before this step.
        for s in out.scheduled_seq_groups:
            for seq in s.seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.num_computed_tokens += s.token_chunk_size
        out.num_prefill_groups = sum(1 for s in out.scheduled_seq_groups if s.is_prompt)
        return metadata, out

    def _schedule_running(self, out: SchedulerOutputs, budget: _Budget) -> bool:
        # Arrival order (swap-in and readmission after recompute can append out of order), so
        # the victims popped from the end are the groups that arrived last.
        queue = deque(sorted(self.running, key=lambda g: g.metrics.arrival_time))
        self.running = []
        preempted = False
        while queue:
            group = queue.popleft()
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            chunk = self._chunk_size(seqs, budget)
            if chunk == 0:
                self.running.append(group)  # stays running; no budget left this step
                continue
            while not self._can_append(seqs, chunk):
                preempted = True
                if queue:
                    self._preempt(queue.pop(), out)  # the last to arrive goes first
                else:
                    self._preempt(group, out)
                    group = None
                    break
            if group is None:
                break
            self._schedule_group(group, seqs, chunk, out, budget)
            self.running.append(group)
        return preempted

    def _schedule_swapped(self, out: SchedulerOutputs, budget: _Budget) -> None:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            status = self.block_manager.can_swap_in(group)
            if status == AllocStatus.NEVER:  # it grew past the whole cache: it can never resume
                self.swapped.popleft()
                self._free_group(group, SequenceStatus.FINISHED_LENGTH)
                out.ignored_seq_groups.append(group)
                continue
            if (status != AllocStatus.OK
                    or self._num_running_seqs() + group.max_num_running_seqs()
                    > self.config.max_num_seqs
                    or budget.tokens_left < len(seqs)):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                seq.worker_synced = False  # its block table changed wholesale
                seq.num_blocks_sent = 0
            chunk = self._chunk_size(seqs, budget)
            self._schedule_group(group, seqs, chunk, out, budget)
            self.running.append(group)

    def _schedule_waiting(self, out: SchedulerOutputs, budget: _Budget, now: float) -> None:
        while self.waiting and budget.tokens_left > 0:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if len(seqs[0]) > self.config.max_model_len:
                self._ignore(group, out)
                continue
            if self._num_running_seqs() + group.max_num_running_seqs() > self.config.max_num_seqs:
                break
            want = len(seqs[0]) if not self.config.enable_chunked_prefill else min(
                len(seqs[0]), budget.tokens_left)
            if not self.config.enable_chunked_prefill and want > budget.tokens_left:
                break
            # The whole sequence must fit in the cache, not only its first chunk: one that never
            # can would be preempted mid-prefill and readmitted forever.
            status = self.block_manager.can_allocate(group, len(seqs[0]))
            if status != AllocStatus.NEVER and want < len(seqs[0]):
                status = self.block_manager.can_allocate(group, want)
            if status == AllocStatus.NEVER:
                self._ignore(group, out)
                continue
            if status == AllocStatus.LATER:
                break
            # Sequences of a group advance in lockstep: all take the same prefix hit. Prompt
            # logprobs need every prompt position computed once.
            cap = min(self.block_manager.get_num_cached_tokens(s) for s in seqs)
            if group.prompt_logprobs is not None and len(group.prompt_logprobs) < group.prompt_len:
                cap = 0
            for seq in seqs:
                seq.num_computed_tokens = self.block_manager.allocate_prefix(seq, cap)
                seq.status = SequenceStatus.RUNNING
            chunk = self._chunk_size(seqs, budget)
            if chunk == 0 or not self._can_append(seqs, chunk):
                for seq in seqs:  # could not fit after all: back to waiting, untouched
                    self.block_manager.free(seq)
                    seq.status = SequenceStatus.WAITING
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
                group.metrics.time_in_queue = now - group.metrics.arrival_time
            if group.num_cached_tokens is None:  # (a resumed request's hit may reach past
                # its prompt, into the output it is recomputing: only the prompt's part counts)
                group.num_cached_tokens = min(seqs[0].num_computed_tokens, group.prompt_len)
            self._schedule_group(group, seqs, chunk, out, budget)
            self.running.append(group)

    def _reserve_lookahead(self, out: SchedulerOutputs, budget: _Budget) -> None:
        """Speculative decoding: room for up to k proposals after each decode that may
        speculate (blocks and batch budget permitting; never by preempting anything), unless
        more sequences decode this step than `disable_by_batch_size`."""
        spec = self.speculative_config
        decodes = [s for s in out.scheduled_seq_groups
                   if s.do_sample and not s.is_prompt and s.token_chunk_size == 1]
        num_decoding = sum(len(s.seq_group.get_seqs(SequenceStatus.RUNNING)) for s in decodes)
        if num_decoding == 0:
            return
        if num_decoding > spec.disable_by_batch_size:
            self.num_steps_speculation_off += 1
            return
        bm = self.block_manager
        for scheduled in decodes:
            group = scheduled.seq_group
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            if len(seqs) != 1:
                continue
            seq = seqs[0]
            num_out = len(seq) - seq.prompt_len  # in-flight samples included
            params = group.sampling_params
            if not may_speculate(params, num_out):
                continue
            # The step emits at most k + 1 tokens: within max_tokens and max_model_len.
            k = min(spec.num_speculative_tokens, self.config.max_model_len - len(seq) - 1,
                    budget.tokens_left)
            if params.max_tokens is not None:
                k = min(k, params.max_tokens - num_out - 1)
            if k <= 0:
                continue
            if (bm.get_num_free_device_blocks() - bm.num_blocks_to_append(seq, 1 + k)
                    < bm.watermark_blocks):
                continue
            copies = bm.append_slots(seq, 1 + k)
            assert not copies, "lookahead slots lie past every block the sequence shares"
            scheduled.num_lookahead_slots = k
            budget.tokens_left -= k
            out.num_batched_tokens += k
            out.num_lookahead_slots = max(out.num_lookahead_slots, k)

    def _can_append(self, seqs: list[Sequence], chunk: int) -> bool:
        bm = self.block_manager
        return sum(bm.num_blocks_to_append(s, chunk) for s in seqs) <= bm.get_num_free_device_blocks()

    def _chunk_size(self, seqs: list[Sequence], budget: _Budget) -> int:
        uncomputed = {s.num_uncomputed_tokens for s in seqs}
        # Sequences of one group advance in lockstep (forked together, preempted together).
        assert len(uncomputed) == 1, f"sequences of a group out of step: {uncomputed}"
        need = uncomputed.pop()
        if (need > 1 and not self.config.enable_chunked_prefill
                and need * len(seqs) <= self.config.max_num_batched_tokens):
            return need if need * len(seqs) <= budget.tokens_left else 0
        # Chunked prefill; or, without it, forks resumed by recompute that together outgrow any
        # step (each alone fits): in chunks, or never.
        return max(0, min(need, budget.tokens_left // len(seqs)))

    def _schedule_group(self, group: SequenceGroup, seqs: list[Sequence], chunk: int,
                        out: SchedulerOutputs, budget: _Budget) -> None:
        for seq in seqs:
            copies = self.block_manager.append_slots(seq, chunk)
            if copies:
                out.blocks_to_copy.extend(copies)
                # Copy-on-write replaced a block the worker already has: resend the table.
                seq.worker_synced = False
                seq.num_blocks_sent = 0
        first = seqs[0]
        is_prompt = chunk > 1 or first.num_computed_tokens < group.prompt_len
        do_sample = first.num_computed_tokens + chunk == len(first)
        out.scheduled_seq_groups.append(ScheduledSequenceGroup(group, chunk, is_prompt, do_sample))
        out.num_batched_tokens += chunk * len(seqs)
        budget.tokens_left -= chunk * len(seqs)

    def _metadata(self, scheduled: ScheduledSequenceGroup) -> SequenceGroupMetadata:
        group = scheduled.seq_group
        seq_data = []
        send_params = False
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            table = self.block_manager.get_block_table(seq)
            if seq.worker_synced:
                sd = SequenceData(seq.seq_id, seq.num_computed_tokens,
                                  block_ids=table[seq.num_blocks_sent:])
            elif seq.parent_seq_id >= 0:
                # The worker builds the child from the parent's prompt and its fan-out sample.
                sd = SequenceData(seq.seq_id, seq.num_computed_tokens, block_ids=list(table),
                                  parent_seq_id=seq.parent_seq_id, sample_index=seq.sample_index)
                seq.parent_seq_id = -1
            else:
                sd = SequenceData(seq.seq_id, seq.num_computed_tokens,
                                  new_token_ids=list(seq.token_ids), block_ids=list(table), reset=True,
                                  sample_index=seq.sample_index)
                send_params = True
            seq.worker_synced = seq.seen_by_worker = True
            seq.num_blocks_sent = len(table)
            seq_data.append(sd)
        send_params = send_params or not group.params_sent
        group.params_sent = True
        return SequenceGroupMetadata(
            request_id=group.request_id, is_prompt=scheduled.is_prompt, seq_data=seq_data,
            token_chunk_size=scheduled.token_chunk_size, do_sample=scheduled.do_sample,
            prompt_len=group.prompt_len,
            sampling_params=group.sampling_params if send_params else None, seed=group.seed,
            eos_token_ids=group.eos_token_ids if send_params else [],
            num_lookahead_slots=scheduled.num_lookahead_slots)

    # -- preemption ----------------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        out.num_preempted += 1
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(group):
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            # Victims go last-arrived first, and arrived before any group already swapped out:
            # at the front, the swapped queue stays in arrival order.
            self.swapped.appendleft(group)
            self.num_preemptions["swap"] += 1
            return
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            seq.reset_for_recompute()
        self.waiting.appendleft(group)
        self.num_preemptions["recompute"] += 1

    def recompute_all(self) -> int:
        """The worker's KV cache (device and swap) died with the worker: every running or
        swapped group goes back to waiting, to be prefilled again from its tokens (which stay),
        the waiting queue in arrival order, and the block manager starts empty. Returns the
        number of groups that lost their cache."""
        lost = list(self.running) + list(self.swapped)
        self.running, self.swapped = [], deque()
        for group in lost + list(self.waiting):
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.WAITING
                seq.reset_for_recompute()
        self.waiting = deque(sorted(lost + list(self.waiting),
                                    key=lambda g: g.metrics.arrival_time))
        self._finished_seq_ids = []  # the new worker never held them
        self.block_manager = self._new_block_manager()
        self.num_preemptions["recompute"] += len(lost)
        return len(lost)

    def _free_group(self, group: SequenceGroup, status: SequenceStatus) -> None:
        for seq in group.unfinished_seqs():
            self._free_seq(seq)
            seq.status = status

    def _ignore(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        self.waiting.popleft()
        self._free_group(group, SequenceStatus.FINISHED_LENGTH)  # preempted: the worker knows it
        out.ignored_seq_groups.append(group)

    def _num_running_seqs(self) -> int:
        return sum(g.max_num_running_seqs() for g in self.running)
