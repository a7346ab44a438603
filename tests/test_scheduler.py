"""Scheduler + BlockManager without a model: a fake worker whose KV slots hold token ids (checked
on every step) and a fake sampler whose token depends only on (request, sample, position)."""
import itertools
import random

import pytest

from services.engine.scheduler import Scheduler, SchedulerOutputs
from services.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from services.engine.stop_checker import check_stop
from shared.config import CacheConfig, SchedulerConfig
from shared.sampling_params import SamplingParams

BS = 4  # block size in every test
MAX_STEPS = 2000


def make_scheduler(num_device_blocks=64, num_cpu_blocks=64, max_num_batched_tokens=64,
                   max_num_seqs=32, chunked=True, mode="recompute", prefix_caching=True,
                   max_model_len=256) -> Scheduler:
    cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, kv_cache_space_gib=None,
                        swap_space_gib=1.0, num_gpu_blocks_override=None,
                        enable_prefix_caching=prefix_caching,
                        num_device_blocks=num_device_blocks, num_cpu_blocks=num_cpu_blocks)
    config = SchedulerConfig(max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked,
                             preemption_mode=mode)
    return Scheduler(config, cache)


def fake_token(request_id: str, sample_index: int, position: int) -> int:
    return random.Random(f"{request_id}/{sample_index}/{position}").randrange(100, 1000)


class FakeWorker:
    """Mirrors what the real worker keeps (each sequence's block table, built from the step's
    deltas) and a KV cache whose slots hold the token id computed there. Every step it checks
    that each sequence reads back its own tokens from its cached positions."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int):
        self.device = [[None] * BS for _ in range(num_device_blocks)]
        self.cpu = [[None] * BS for _ in range(num_cpu_blocks)]
        self.tables: dict[int, list[int]] = {}

    def execute(self, metadata, out: SchedulerOutputs, seqs: dict[int, Sequence], bm) -> None:
        for d, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.device[d])
        for c, d in out.blocks_to_swap_in:
            self.device[d] = list(self.cpu[c])
        sources = {s: list(self.device[s]) for s, _ in out.blocks_to_copy}
        for s, d in out.blocks_to_copy:
            self.device[d] = list(sources[s])
        for group in metadata:
            for sd in group.seq_data:
                if sd.reset or sd.parent_seq_id >= 0:
                    self.tables[sd.seq_id] = list(sd.block_ids)
                else:
                    assert sd.seq_id in self.tables, f"seq {sd.seq_id}: a delta with no state"
                    self.tables[sd.seq_id].extend(sd.block_ids)
        for seq_id in out.finished_seq_ids:
            self.tables.pop(seq_id, None)
        for group in metadata:
            for sd in group.seq_data:
                seq, table = seqs[sd.seq_id], self.tables[sd.seq_id]
                assert table == bm.get_block_table(seq), f"seq {sd.seq_id}: stale block table"
                start, end = sd.num_computed_tokens, sd.num_computed_tokens + group.token_chunk_size
                for p in range(start):
                    assert self.device[table[p // BS]][p % BS] == seq.token_ids[p], (
                        f"seq {sd.seq_id} reads a wrong KV at position {p}")
                for p in range(start, end):
                    self.device[table[p // BS]][p % BS] = seq.token_ids[p]


class FakeEngine:
    """Drives a Scheduler the way LLMEngine does (placeholders, n > 1 forks, stop checks),
    and checks the per-step invariants."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.bm = scheduler.block_manager
        self.worker = FakeWorker(self.bm.num_device_blocks, self.bm.num_cpu_blocks)
        self.seq_ids = itertools.count()
        self.seqs: dict[int, Sequence] = {}
        self.groups: dict[str, SequenceGroup] = {}
        self.history: list[SchedulerOutputs] = []
        self.victims: list[SequenceGroup] = []

    def add(self, prompt: list[int], max_tokens: int = 8, n: int = 1,
            arrival_time: float | None = None, **params) -> SequenceGroup:
        seq = Sequence(next(self.seq_ids), prompt)
        self.seqs[seq.seq_id] = seq
        request_id = f"r{len(self.groups)}"
        params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=max_tokens,
                                **params)
        group = SequenceGroup(request_id, None, prompt, params, seq, seed=0, eos_token_ids=[],
                              arrival_time=float(len(self.groups)) if arrival_time is None
                              else arrival_time)
        self.groups[request_id] = group
        self.scheduler.add_seq_group(group)
        return group

    def step(self) -> SchedulerOutputs:
        s = self.scheduler
        running_before = list(s.running)
        metadata, out = s.schedule()
        self.history.append(out)
        # 1) Invariants of every step.
        seq_ids = [sd.seq_id for m in metadata for sd in m.seq_data]
        assert len(seq_ids) == len(set(seq_ids)), f"a sequence scheduled twice: {seq_ids}"
        request_ids = [m.request_id for m in metadata]
        assert len(request_ids) == len(set(request_ids)), f"a group scheduled twice: {request_ids}"
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        assert out.num_batched_tokens == sum(m.token_chunk_size * len(m.seq_data) for m in metadata)
        assert all(m.token_chunk_size > 0 for m in metadata)
        # 2) Preemption takes the groups that arrived last.
        victims = [g for g in running_before
                   if any(q.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED)
                          for q in g.seqs)]
        survivors = [g for g in running_before if g not in victims and not g.is_finished()]
        if victims and survivors:
            assert (max(g.metrics.arrival_time for g in survivors)
                    < min(g.metrics.arrival_time for g in victims)), "preempted a group that " \
                                                                     "arrived before a survivor"
        self.victims += victims
        if out.is_empty():
            return out
        # 2) The step's samples: placeholders now (the engine's schedule_step), filled after the
        #    worker ran (its process_model_outputs).
        sampling = []
        for scheduled in out.scheduled_seq_groups:
            if scheduled.do_sample:
                sampling.append(scheduled.seq_group)
                self._expect_samples(scheduled.seq_group)
        num_running = sum(len(g.get_seqs(SequenceStatus.RUNNING)) for g in s.running)
        assert num_running <= s.config.max_num_seqs, "more sequences than max_num_seqs"
        self.worker.execute(metadata, out, self.seqs, self.bm)
        for group in sampling:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                position = len(seq) - 1
                seq.fill_placeholder(fake_token(group.request_id, seq.sample_index, position),
                                     0.0, None)
                check_stop(seq, group.sampling_params, group.eos_token_ids,
                           s.config.max_model_len)
                if seq.is_finished():
                    seq.drop_placeholders()
        s.free_finished_seq_groups()
        return out

    def _expect_samples(self, group: SequenceGroup) -> None:
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        n = group.sampling_params.n
        if n > 1 and len(group.seqs) == 1 and seqs[0].num_output_tokens == 0:
            parent = seqs[0]
            for j in range(1, n):
                child = Sequence(next(self.seq_ids), group.prompt_token_ids, sample_index=j)
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                child.parent_seq_id = parent.seq_id
                self.scheduler.fork_seq(parent, child)
                group.seqs.append(child)
                self.seqs[child.seq_id] = child
                seqs.append(child)
        for seq in seqs:
            seq.append_placeholder()

    def run(self) -> dict[str, list[list[int]]]:
        for _ in range(MAX_STEPS):
            if not self.scheduler.has_unfinished_seqs():
                break
            self.step()
        assert not self.scheduler.has_unfinished_seqs(), "the scheduler stopped making progress"
        return {rid: [s.output_token_ids for s in sorted(g.seqs, key=lambda s: s.sample_index)]
                for rid, g in self.groups.items()}

    def assert_every_block_free(self) -> None:
        bm = self.bm
        assert bm.get_num_free_device_blocks() == bm.num_device_blocks
        assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
        assert all(b.ref_count == 0 for b in bm.device_pool.blocks + bm.cpu_pool.blocks)


def prompt(length: int, start: int = 1) -> list[int]:
    return list(range(start, start + length))


def expected_outputs(groups: list[tuple[list[int], int, int]]) -> dict[str, list[list[int]]]:
    """What the fake sampler produces for (prompt, max_tokens, n) requests."""
    return {f"r{i}": [[fake_token(f"r{i}", j, len(p) + k) for k in range(max_tokens)]
                      for j in range(n)]
            for i, (p, max_tokens, n) in enumerate(groups)}


def add_all(engine: FakeEngine, groups) -> None:
    for p, max_tokens, n in groups:
        engine.add(p, max_tokens=max_tokens, n=n)


# --- a whole run -----------------------------------------------------------------------------

def test_a_run_generates_every_token_and_frees_every_block():
    requests = [(prompt(5), 6, 1), (prompt(13, 50), 9, 1), (prompt(7, 200), 4, 3)]
    engine = FakeEngine(make_scheduler())
    add_all(engine, requests)
    assert engine.run() == expected_outputs(requests)
    engine.assert_every_block_free()


def random_workload(seed: int, mode: str) -> tuple[FakeEngine, list]:
    """A tight cache, some prompts sharing a prefix, n up to 3, sometimes too few CPU blocks to
    swap (swap mode then falls back to recompute). Every request fits in the cache alone."""
    rng = random.Random(seed)
    num_blocks = rng.randint(14, 20)
    shared = prompt(8, 900)
    requests = []
    for _ in range(rng.randint(3, 8)):
        p = prompt(rng.randint(1, 20), rng.randint(1, 800))
        if rng.random() < 0.3:
            p = shared + p[:12]
        max_tokens, n = rng.randint(1, 16), rng.choice([1, 1, 2, 3])
        if n * -(-(len(p) + max_tokens) // BS) > num_blocks:
            n = 1
        requests.append((p, max_tokens, n))
    chunked = rng.random() < 0.7
    engine = FakeEngine(make_scheduler(
        num_device_blocks=num_blocks, num_cpu_blocks=rng.choice([4, 64]),
        max_num_batched_tokens=rng.choice([8, 16, 64]) if chunked else 64, chunked=chunked,
        mode=mode, max_num_seqs=rng.choice([4, 8, 32]), prefix_caching=rng.random() < 0.7,
        max_model_len=64))
    add_all(engine, requests)
    return engine, requests


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_random_workloads_keep_every_invariant(mode):
    num_preemptions = 0
    for seed in range(100):
        engine, requests = random_workload(seed, mode)
        try:
            assert engine.run() == expected_outputs(requests)
            engine.assert_every_block_free()
        except AssertionError as e:
            raise AssertionError(f"workload seed {seed}: {e}") from e
        num_preemptions += sum(engine.scheduler.num_preemptions.values())
    print(f"{mode}: 100 random workloads, {num_preemptions} preemptions, invariants held")
    assert num_preemptions > 100


# --- prefix caching and forks ----------------------------------------------------------------

def test_a_common_prefix_is_computed_once_and_its_blocks_shared_and_counted():
    engine = FakeEngine(make_scheduler())
    first = engine.add(prompt(20), max_tokens=4)
    engine.step()
    second = engine.add(prompt(16) + prompt(6, 500), max_tokens=4)
    out = engine.step()
    bm = engine.bm
    scheduled = {s.seq_group.request_id: s for s in out.scheduled_seq_groups}
    # 16 of the 22 prompt tokens (4 full blocks) come from the cache; 6 are computed.
    assert scheduled[second.request_id].token_chunk_size == 6
    shared = bm.get_block_table(first.first_seq)[:4]
    assert bm.get_block_table(second.first_seq)[:4] == shared
    assert all(bm.device_pool.blocks[b].ref_count == 2 for b in shared)
    # Lookups: the first prompt's 4 eligible blocks (all misses), the second's 5 (4 hits).
    assert bm.num_hit_blocks == 4
    assert bm.prefix_cache_hit_rate == pytest.approx(4 / 9)
    engine.run()
    engine.assert_every_block_free()


def test_prefix_caching_off_shares_nothing():
    engine = FakeEngine(make_scheduler(prefix_caching=False))
    first = engine.add(prompt(20), max_tokens=4)
    engine.step()
    second = engine.add(prompt(20), max_tokens=4)
    engine.step()
    assert not set(engine.bm.get_block_table(first.first_seq)) & set(
        engine.bm.get_block_table(second.first_seq))
    assert engine.bm.prefix_cache_hit_rate == 0.0


def test_forked_samples_share_the_prompt_and_copy_the_last_block_on_write():
    engine = FakeEngine(make_scheduler())
    group = engine.add(prompt(6), max_tokens=5, n=2)
    engine.step()  # the prompt, and the fork
    parent, child = group.seqs
    bm = engine.bm
    assert bm.get_block_table(parent) == bm.get_block_table(child)
    shared_last = bm.get_block_table(parent)[1]  # positions 4..7, the prompt fills 4 and 5
    out = engine.step()  # both write position 6 into that block
    assert len(out.blocks_to_copy) == 1 and out.blocks_to_copy[0][0] == shared_last
    parent_table, child_table = bm.get_block_table(parent), bm.get_block_table(child)
    assert parent_table[0] == child_table[0]  # the full first block stays shared
    assert parent_table[1] != child_table[1]
    assert parent.output_token_ids != child.output_token_ids  # each read its own KV (FakeWorker)
    engine.run()
    engine.assert_every_block_free()


# --- chunked prefill -------------------------------------------------------------------------

def test_chunked_prefill_keeps_every_step_within_the_token_budget_and_mixes_in_decodes():
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=16))
    engine.add(prompt(3), max_tokens=12)
    engine.add(prompt(5, 100), max_tokens=12)
    engine.step()
    long = engine.add(prompt(50, 300), max_tokens=3)
    engine.run()
    assert all(out.num_batched_tokens <= 16 for out in engine.history)
    mixed = [out for out in engine.history
             if any(s.is_prompt and s.token_chunk_size > 1 for s in out.scheduled_seq_groups)
             and any(not s.is_prompt and s.token_chunk_size == 1
                     for s in out.scheduled_seq_groups)]
    assert mixed, "no step mixed a prefill chunk with decodes"
    long_chunks = [s.token_chunk_size for out in engine.history for s in out.scheduled_seq_groups
                   if s.seq_group is long and s.is_prompt]
    assert sum(long_chunks) == 50 and len(long_chunks) >= 4
    assert max(long_chunks) <= 16 - 2  # the two decodes went first


def test_without_chunked_prefill_a_prompt_is_never_split():
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=64, chunked=False))
    for i in range(4):
        engine.add(prompt(30, 100 * i), max_tokens=3)
    engine.run()
    prompt_chunks = [s.token_chunk_size for out in engine.history
                     for s in out.scheduled_seq_groups if s.is_prompt]
    assert prompt_chunks == [30] * 4
    assert all(out.num_batched_tokens <= 64 for out in engine.history)


# --- preemption ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_groups_are_the_last_to_arrive_and_resume_with_the_same_output(mode):
    requests = [(prompt(8, 100 * i), 12, 1) for i in range(4)]
    # Each request ends at 20 tokens = 5 blocks; all four need 20 of the 12 blocks.
    engine = FakeEngine(make_scheduler(num_device_blocks=12, mode=mode))
    add_all(engine, requests)
    assert engine.run() == expected_outputs(requests)
    other = "swap" if mode == "recompute" else "recompute"
    assert engine.scheduler.num_preemptions[mode] > 0
    assert engine.scheduler.num_preemptions[other] == 0
    assert engine.victims and all(g.request_id != "r0" for g in engine.victims)
    if mode == "swap":
        assert any(out.blocks_to_swap_out for out in engine.history)
        assert any(out.blocks_to_swap_in for out in engine.history)
    engine.assert_every_block_free()


def test_swap_preemption_of_a_forked_group_resumes_every_sample():
    requests = [(prompt(6), 10, 1), (prompt(6, 100), 10, 3)]
    engine = FakeEngine(make_scheduler(num_device_blocks=10, mode="swap"))
    add_all(engine, requests)
    assert engine.run() == expected_outputs(requests)
    assert engine.scheduler.num_preemptions["swap"] > 0
    engine.assert_every_block_free()


def test_swap_falls_back_to_recompute_when_cpu_blocks_run_out():
    requests = [(prompt(8, 100 * i), 12, 1) for i in range(3)]
    engine = FakeEngine(make_scheduler(num_device_blocks=10, num_cpu_blocks=1, mode="swap"))
    add_all(engine, requests)
    assert engine.run() == expected_outputs(requests)
    assert engine.scheduler.num_preemptions["recompute"] > 0
    engine.assert_every_block_free()


# --- abort -----------------------------------------------------------------------------------

def test_abort_frees_the_blocks_of_a_waiting_a_running_and_a_swapped_group():
    engine = FakeEngine(make_scheduler(num_device_blocks=8, mode="swap"))
    running = engine.add(prompt(12), max_tokens=20)
    swapped = engine.add(prompt(12, 100), max_tokens=20)
    for _ in range(20):
        engine.step()
        if engine.scheduler.swapped:
            break
    waiting = engine.add(prompt(12, 200), max_tokens=20)
    engine.step()
    s, bm = engine.scheduler, engine.bm
    assert list(s.swapped) == [swapped] and s.running == [running] and list(s.waiting) == [waiting]
    assert bm.get_num_free_cpu_blocks() < bm.num_cpu_blocks

    assert s.abort_seq_group(swapped.request_id) == [swapped]
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    assert s.abort_seq_group(running.request_id) == [running]
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert s.abort_seq_group(waiting.request_id) == [waiting]
    assert not s.has_unfinished_seqs()
    for group in (running, swapped, waiting):
        assert all(q.status == SequenceStatus.FINISHED_ABORTED for q in group.seqs)
    engine.assert_every_block_free()


def test_abort_of_a_forked_group_frees_every_sample():
    engine = FakeEngine(make_scheduler())
    group = engine.add(prompt(9), max_tokens=20, n=3)
    engine.step()
    engine.step()
    assert len(group.seqs) == 3
    engine.scheduler.abort_seq_group([group.request_id])
    engine.assert_every_block_free()


def test_the_worker_is_told_to_drop_every_aborted_sequence_it_has_seen():
    # A group preempted by recompute still has state in the worker while it waits.
    engine = FakeEngine(make_scheduler(num_device_blocks=12))
    for i in range(4):
        engine.add(prompt(8, 100 * i), max_tokens=12)
    victim = None
    for _ in range(40):
        engine.step()
        if engine.scheduler.waiting:
            victim = engine.scheduler.waiting[0]
            break
    assert victim is not None and victim.first_seq.seq_id in engine.worker.tables
    engine.scheduler.abort_seq_group(victim.request_id)
    engine.run()
    assert victim.first_seq.seq_id not in engine.worker.tables
    told = {i for out in engine.history for i in out.finished_seq_ids}
    assert victim.first_seq.seq_id in told


# --- requests that cannot be served ----------------------------------------------------------

@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_too_long_for_the_cache_is_ignored_without_blocking_the_queue(chunked):
    engine = FakeEngine(make_scheduler(num_device_blocks=8, max_num_batched_tokens=16 if chunked
                                       else 64, chunked=chunked))
    too_long = engine.add(prompt(40), max_tokens=2)
    after = engine.add(prompt(6, 100), max_tokens=4)
    outputs = engine.run()
    ignored = [g for out in engine.history for g in out.ignored_seq_groups]
    assert ignored == [too_long]
    assert too_long.first_seq.status == SequenceStatus.FINISHED_LENGTH
    assert outputs[after.request_id] == expected_outputs([(prompt(40), 2, 1),
                                                          (prompt(6, 100), 4, 1)])["r1"]
    engine.assert_every_block_free()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_sequence_that_outgrows_the_cache_ends_instead_of_looping(mode):
    engine = FakeEngine(make_scheduler(num_device_blocks=4, max_num_batched_tokens=8, mode=mode))
    group = engine.add(prompt(6), max_tokens=40)
    engine.run()
    assert group.first_seq.status == SequenceStatus.FINISHED_LENGTH
    assert group.first_seq.num_output_tokens >= 16 - 6 - 1  # it ran until the cache was full
    engine.assert_every_block_free()


def test_max_num_seqs_counts_the_samples_a_group_will_fork():
    engine = FakeEngine(make_scheduler(max_num_seqs=4))
    engine.add(prompt(5), max_tokens=6, n=3)
    engine.add(prompt(5, 100), max_tokens=6, n=3)
    engine.run()  # FakeEngine.step checks the number of running sequences every step
    engine.assert_every_block_free()


def test_forks_resumed_by_recompute_that_outgrow_a_step_resume_in_chunks():
    # Without chunked prefill: the 3 samples of r1 are preempted at about 25 tokens each, and
    # recomputing them exceeds the 64-token budget of a step.
    engine = FakeEngine(make_scheduler(num_device_blocks=24, max_num_batched_tokens=64,
                                       chunked=False, max_model_len=64, prefix_caching=False))
    requests = [(prompt(40, 100), 20, 1), (prompt(16, 500), 12, 3)]
    add_all(engine, requests)
    assert engine.run() == expected_outputs(requests)
    assert engine.scheduler.num_preemptions["recompute"] > 0
    resumed = [s.token_chunk_size for out in engine.history for s in out.scheduled_seq_groups
               if s.seq_group.request_id == "r1" and s.is_prompt and len(s.seq_group.seqs) == 3]
    assert len(resumed) >= 2 and sum(resumed) > 16 and max(resumed) * 3 <= 64
    engine.assert_every_block_free()


def test_arrival_time_zero_is_kept():
    engine = FakeEngine(make_scheduler())
    group = engine.add(prompt(3), arrival_time=0.0)
    assert group.metrics.arrival_time == 0.0
