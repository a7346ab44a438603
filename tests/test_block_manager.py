"""BlockManager: paged block allocation, prefix caching, fork copy-on-write, swap."""
import itertools
import os
import random
import subprocess
import sys

import pytest

from services.engine import block_hash
from services.engine.block_manager import AllocStatus, BlockManager
from services.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from shared.sampling_params import SamplingParams

BS = 4  # block size in every test
_ids = itertools.count()


def make_group(prompt: list[int], cache_salt: str | None = None) -> SequenceGroup:
    seq = Sequence(next(_ids), prompt, cache_salt=cache_salt)
    return SequenceGroup(f"req-{seq.seq_id}", None, prompt, SamplingParams(), seq, seed=0,
                         eos_token_ids=[])


def make_manager(num_device_blocks=16, num_cpu_blocks=16, prefix_caching=True, watermark=0.0):
    return BlockManager(BS, num_device_blocks, num_cpu_blocks, prefix_caching, watermark)


class FakeKVCache:
    """Stands in for the worker: each slot holds the token id whose KV it would hold, so a
    sequence's cache can be read back and compared with its tokens."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.device = [[None] * BS for _ in range(bm.num_device_blocks)]
        self.cpu = [[None] * BS for _ in range(bm.num_cpu_blocks)]

    def copy(self, pairs, src, dst):
        for s, d in pairs:
            dst[d] = list(src[s])

    def schedule(self, seq: Sequence, num_new_tokens: int,
                 sampled: int | None = None) -> list[tuple[int, int]]:
        """One step for one sequence: blocks, copies, KV writes, then the computed count.
        `sampled` fills the sequence's placeholder after scheduling, before the writes: the
        worker knows a token the engine has not read yet."""
        copies = self.bm.append_slots(seq, num_new_tokens)
        if sampled is not None:
            seq.fill_placeholder(sampled, 0.0, None)
        self.copy(copies, self.device, self.device)
        table = self.bm.get_block_table(seq)
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens):
            self.device[table[p // BS]][p % BS] = seq.token_ids[p]
        seq.num_computed_tokens += num_new_tokens
        return copies

    def prefill(self, seq: Sequence) -> int:
        num_cached = self.bm.allocate_prefix(seq)
        seq.num_computed_tokens = num_cached
        self.schedule(seq, len(seq) - num_cached)
        return num_cached

    def decode(self, seq: Sequence, token_id: int) -> list[tuple[int, int]]:
        """Compute the token sampled last, scheduled while it is still in flight."""
        seq.append_placeholder()
        return self.schedule(seq, 1, sampled=token_id)

    def read(self, seq: Sequence) -> list[int]:
        table = self.bm.get_block_table(seq)
        return [self.device[table[p // BS]][p % BS] for p in range(seq.num_computed_tokens)]


def fork(bm: BlockManager, group: SequenceGroup, parent: Sequence) -> Sequence:
    child = Sequence(next(_ids), group.prompt_token_ids, sample_index=len(group.seqs),
                     cache_salt=group.cache_salt)
    child.token_ids = list(parent.token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    group.seqs.append(child)
    bm.fork(parent, child)
    return child


def ref_count(bm: BlockManager, block_id: int) -> int:
    return bm.device_pool.blocks[block_id].ref_count


def prefilled(bm, cache, prompt, cache_salt=None):
    group = make_group(prompt, cache_salt)
    cache.prefill(group.first_seq)
    return group.first_seq


# --- admission ---

def test_request_larger_than_the_cache_is_never_allocated():
    bm = make_manager(num_device_blocks=10)
    assert bm.can_allocate(make_group(list(range(41))), 41) == AllocStatus.NEVER
    assert bm.can_allocate(make_group(list(range(40))), 40) == AllocStatus.OK


def test_request_that_fits_later_waits_while_blocks_are_held():
    bm = make_manager(num_device_blocks=10, prefix_caching=False)
    cache = FakeKVCache(bm)
    holder = prefilled(bm, cache, list(range(24)))  # 6 blocks
    waiting = make_group(list(range(100, 120)))  # 5 blocks
    assert bm.can_allocate(waiting, 20) == AllocStatus.LATER
    bm.free(holder)
    assert bm.can_allocate(waiting, 20) == AllocStatus.OK


def test_admission_leaves_the_watermark_free():
    bm = make_manager(num_device_blocks=100, prefix_caching=False, watermark=0.05)  # 5 blocks
    cache = FakeKVCache(bm)
    prefilled(bm, cache, list(range(50 * BS)))
    assert bm.can_allocate(make_group([1] * 45 * BS), 45 * BS) == AllocStatus.OK
    assert bm.can_allocate(make_group([1] * 46 * BS), 46 * BS) == AllocStatus.LATER
    assert bm.can_allocate(make_group([1] * 96 * BS), 96 * BS) == AllocStatus.NEVER


def test_admission_counts_every_unfinished_sequence_of_the_group():
    bm = make_manager(num_device_blocks=10)
    group = make_group(list(range(20)))  # 5 blocks per sequence
    group.seqs.append(Sequence(next(_ids), list(range(20)), sample_index=1))
    assert bm.can_allocate(group, 20) == AllocStatus.OK
    group.seqs.append(Sequence(next(_ids), list(range(20)), sample_index=2))
    assert bm.can_allocate(group, 20) == AllocStatus.NEVER


def test_admission_does_not_charge_for_prefix_blocks_other_sequences_hold():
    bm = make_manager(num_device_blocks=10)
    cache = FakeKVCache(bm)
    prefilled(bm, cache, list(range(24)))  # 6 blocks held
    waiting = make_group(list(range(24)) + [99, 98, 97, 96, 95, 94])  # 8 blocks, 6 cached
    assert bm.can_allocate(waiting, len(waiting.first_seq)) == AllocStatus.OK
    assert cache.prefill(waiting.first_seq) == 24


def test_admission_still_charges_for_cached_blocks_no_one_holds():
    bm = make_manager(num_device_blocks=10)
    cache = FakeKVCache(bm)
    bm.free(prefilled(bm, cache, list(range(24))))  # 6 cached-but-free blocks
    prefilled(bm, cache, list(range(100, 116)))  # takes the 4 uncached ones
    waiting = make_group(list(range(24)) + [99, 98, 97, 96, 95, 94])  # 8 blocks, 6 cached
    assert bm.can_allocate(waiting, len(waiting.first_seq)) == AllocStatus.LATER


# --- prefix caching ---

def test_sequences_with_a_common_prefix_share_its_physical_blocks():
    bm = make_manager()
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(12)) + [50, 51])
    b = make_group(list(range(12)) + [60, 61, 62]).first_seq
    free_before = bm.get_num_free_device_blocks()
    assert cache.prefill(b) == 12
    table_a, table_b = bm.get_block_table(a), bm.get_block_table(b)
    assert table_b[:3] == table_a[:3]
    assert table_b[3] != table_a[3]
    assert [ref_count(bm, i) for i in table_a[:3]] == [2, 2, 2]
    assert bm.get_num_free_device_blocks() == free_before - 1
    assert cache.read(b) == b.token_ids


def test_prefix_cache_hits_are_counted():
    bm = make_manager()
    cache = FakeKVCache(bm)
    prefilled(bm, cache, list(range(12)) + [50, 51])  # 3 eligible blocks, 0 hits
    prefilled(bm, cache, list(range(12)) + [60, 61, 62])  # 3 eligible blocks, 3 hits
    assert (bm.num_queried_blocks, bm.num_hit_blocks) == (6, 3)
    assert bm.prefix_cache_hit_rate == pytest.approx(0.5)


def test_prefix_hit_leaves_the_last_token_to_compute():
    bm = make_manager()
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(8)))  # exactly two full blocks
    b = make_group(list(range(8))).first_seq
    assert cache.prefill(b) == 4  # the second block is recomputed into b's own block
    assert bm.get_block_table(b)[0] == bm.get_block_table(a)[0]
    assert bm.get_block_table(b)[1] != bm.get_block_table(a)[1]
    assert cache.read(b) == b.token_ids


def test_prefix_hit_can_be_capped_to_keep_a_group_in_step():
    bm = make_manager()
    cache = FakeKVCache(bm)
    prefilled(bm, cache, list(range(13)))  # 3 cached blocks
    parent = make_group(list(range(13)) + [5]).first_seq
    child = make_group(list(range(8)) + [7, 7, 7, 7, 7, 7]).first_seq
    assert [bm.get_num_cached_tokens(s) for s in (parent, child)] == [12, 8]
    assert bm.num_queried_blocks == 3  # the look-ahead counts nothing
    assert bm.allocate_prefix(parent, max_cached_tokens=8) == 8
    assert len(bm.get_block_table(parent)) == 2


def test_no_blocks_shared_without_prefix_caching():
    bm = make_manager(prefix_caching=False)
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(12)) + [50])
    b = make_group(list(range(12)) + [60]).first_seq
    assert cache.prefill(b) == 0
    assert not set(bm.get_block_table(a)) & set(bm.get_block_table(b))
    assert bm.prefix_cache_hit_rate == 0.0


def test_freed_cached_blocks_are_revived_by_an_identical_prefix():
    bm = make_manager()
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(8)) + [9])
    cached_blocks = bm.get_block_table(a)[:2]
    bm.free(a)
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    b = make_group(list(range(8)) + [7, 7]).first_seq
    assert cache.prefill(b) == 8
    assert bm.get_block_table(b)[:2] == cached_blocks
    assert [ref_count(bm, i) for i in cached_blocks] == [1, 1]
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks - 3
    assert cache.read(b) == b.token_ids


def test_cached_free_blocks_count_as_free_in_usage():
    bm = make_manager(num_device_blocks=8)
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(16)))
    assert bm.usage == pytest.approx(0.5)
    bm.free(a)
    assert bm.usage == 0.0


def test_uncached_free_blocks_are_used_before_cached_ones_are_evicted():
    bm = make_manager(num_device_blocks=9)
    cache = FakeKVCache(bm)
    bm.free(prefilled(bm, cache, list(range(8))))  # 2 cached, 7 uncached free blocks
    prefilled(bm, cache, list(range(100, 124)))  # 6 of the 7 uncached blocks
    again = make_group(list(range(8)) + [1]).first_seq
    assert cache.prefill(again) == 8


def test_least_recently_freed_cached_blocks_are_evicted_first():
    bm = make_manager(num_device_blocks=8)
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(8)))
    b = prefilled(bm, cache, list(range(100, 108)))
    blocks_a = set(bm.get_block_table(a))
    bm.free(a)
    bm.free(b)
    prefilled(bm, cache, list(range(200, 216)))  # the 4 uncached free blocks
    c = prefilled(bm, cache, list(range(300, 308)))  # must evict two cached blocks
    assert set(bm.get_block_table(c)) == blocks_a
    assert bm.allocate_prefix(make_group(list(range(8)) + [1]).first_seq) == 0
    assert bm.allocate_prefix(make_group(list(range(100, 108)) + [1]).first_seq) == 8


def test_a_prefix_tail_is_evicted_before_its_head():
    bm = make_manager(num_device_blocks=4)
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(16)))  # all four blocks cached
    head, tail = bm.get_block_table(a)[0], bm.get_block_table(a)[3]
    bm.free(a)
    evictor = prefilled(bm, cache, [77] * 3)  # one fresh block
    assert bm.get_block_table(evictor) == [tail]
    again = make_group(list(range(16)) + [1]).first_seq
    assert bm.allocate_prefix(again) == 12
    assert bm.get_block_table(again)[0] == head


def test_a_full_block_is_cached_once_its_tokens_are_known():
    bm = make_manager()
    cache = FakeKVCache(bm)
    seq = prefilled(bm, cache, list(range(7)))
    seq.append_placeholder()  # position 7: sampled by a step still in flight
    cache.schedule(seq, 1)
    probe = list(range(7)) + [42, 0]
    assert bm.allocate_prefix(make_group(probe).first_seq) == 4
    seq.fill_placeholder(42, 0.0, None)
    seq.append_placeholder()
    bm.append_slots(seq, 1)  # the next step: positions 4..7 are known now
    assert bm.allocate_prefix(make_group(probe).first_seq) == 8


def test_an_identical_prefix_computed_twice_is_cached_once():
    bm = make_manager()
    cache = FakeKVCache(bm)
    a, b = make_group(list(range(9))).first_seq, make_group(list(range(9))).first_seq
    assert bm.allocate_prefix(a) == 0 and bm.allocate_prefix(b) == 0  # neither computed yet
    cache.schedule(a, 9)
    cache.schedule(b, 9)
    table_a = list(bm.get_block_table(a))
    assert set(table_a).isdisjoint(bm.get_block_table(b))
    bm.free(b)
    bm.free(a)
    c = make_group(list(range(9))).first_seq
    assert cache.prefill(c) == 8
    assert bm.get_block_table(c)[:2] == table_a[:2]  # the first computed copy is the cached one
    assert cache.read(c) == c.token_ids


def test_reset_prefix_cache_is_refused_while_blocks_are_held():
    bm = make_manager()
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(9)))
    assert bm.reset_prefix_cache() is False
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    assert cache.prefill(make_group(list(range(9))).first_seq) == 0


# --- block identity: digests and cache salts ---

_real_block_digest = block_hash.block_digest


def _digest_seeing_two_bytes_of_the_parent(parent: bytes, token_ids: list[int]) -> bytes:
    """A weak block digest: like a short hash of the parent's key, it keeps two bytes of the
    parent's digest, so two prefixes whose parents agree on them get the same child digests."""
    return _real_block_digest(parent[:2], token_ids)


def _two_first_blocks_whose_weak_digests_agree_on_two_bytes() -> tuple[list[int], list[int]]:
    seen: dict[bytes, list[int]] = {}
    for i in itertools.count():  # a birthday search: a few hundred blocks
        block = [7, 7, 7, i]
        head = _digest_seeing_two_bytes_of_the_parent(block_hash.NO_NAMESPACE, block)[:2]
        if head in seen:
            return seen[head], block
        seen[head] = block


def test_prefixes_whose_parent_digests_collide_do_not_share_blocks(monkeypatch):
    a0, b0 = _two_first_blocks_whose_weak_digests_agree_on_two_bytes()
    tail = [50, 51, 52, 53]

    def serve_b() -> tuple[int, bool]:
        """Caches a0+tail and b0, then admits b0+tail: how many tokens b is served from the
        cache, and whether its second block is the one computed after a0."""
        bm = make_manager()
        cache = FakeKVCache(bm)
        a = prefilled(bm, cache, a0 + tail + [1])
        prefilled(bm, cache, b0 + [60] * BS + [1])
        b = make_group(b0 + tail + [2]).first_seq
        num_cached = cache.prefill(b)
        return num_cached, bm.get_block_table(b)[1] == bm.get_block_table(a)[1]

    with monkeypatch.context() as patch:
        patch.setattr(block_hash, "block_digest", _digest_seeing_two_bytes_of_the_parent)
        assert serve_b() == (2 * BS, True)  # the leak the real digest prevents
    assert serve_b() == (BS, False)  # only b0, which b really shares


def test_equal_prefixes_have_equal_digests_and_share_blocks():
    bm = make_manager()
    cache = FakeKVCache(bm)
    a = prefilled(bm, cache, list(range(8)) + [1])
    b = prefilled(bm, cache, list(range(8)) + [2])
    assert bm._tables[b.seq_id].block_hashes == bm._tables[a.seq_id].block_hashes
    assert bm.get_block_table(b)[:2] == bm.get_block_table(a)[:2]


def test_only_requests_with_an_equal_cache_salt_share_blocks():
    bm = make_manager(num_device_blocks=32)
    cache = FakeKVCache(bm)
    prompt = list(range(12)) + [50]
    salts = (None, "tenant-a", "tenant-b")
    first = {}
    for salt in salts:  # no salt, a salt and another salt: none finds another's blocks
        seq = make_group(prompt, salt).first_seq
        assert cache.prefill(seq) == 0, salt
        first[salt] = bm.get_block_table(seq)[:3]
    assert len({b for blocks in first.values() for b in blocks}) == 9
    for salt in salts:  # the same namespace again: all three blocks are found
        seq = make_group(prompt, salt).first_seq
        assert cache.prefill(seq) == 12, salt
        assert bm.get_block_table(seq)[:3] == first[salt]
        assert cache.read(seq) == seq.token_ids


def test_a_salted_fork_and_a_salted_swap_in_cache_blocks_under_the_salt():
    bm = make_manager()
    cache = FakeKVCache(bm)
    group = make_group([1, 2, 3], cache_salt="tenant-a")
    cache.prefill(group.first_seq)
    child = fork(bm, group, group.first_seq)
    cache.decode(child, 4)
    cache.decode(child, 5)  # the child's first block [1, 2, 3, 4] is known: it is cached
    probe = [1, 2, 3, 4, 9]
    assert bm.get_num_cached_tokens(make_group(probe).first_seq) == 0
    assert bm.get_num_cached_tokens(make_group(probe, "tenant-a").first_seq) == 4
    cache.copy(bm.swap_out(group), cache.device, cache.cpu)
    assert bm.reset_prefix_cache()
    cache.copy(bm.swap_in(group), cache.cpu, cache.device)
    assert bm.get_num_cached_tokens(make_group(probe).first_seq) == 0
    assert bm.get_num_cached_tokens(make_group(probe, "tenant-a").first_seq) == 4


def test_a_fork_must_keep_the_cache_salt_of_its_parent():
    bm = make_manager()
    parent = make_group([1, 2, 3], cache_salt="tenant-a").first_seq
    bm.allocate_prefix(parent)
    with pytest.raises(AssertionError, match="salt"):
        bm.fork(parent, Sequence(next(_ids), [1, 2, 3], sample_index=1))


@pytest.mark.parametrize("salt", ["", "x" * 257, b"tenant", 7])
def test_a_cache_salt_must_be_a_short_non_empty_str(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        Sequence(next(_ids), [1, 2, 3], cache_salt=salt)
    assert Sequence(next(_ids), [1], cache_salt="x" * 256).cache_salt == "x" * 256


def test_block_digests_are_32_bytes_and_the_same_in_every_process():
    tokens = [0, 1, 2**31, 2**32 - 1]
    code = ("from services.engine import block_hash as h; "
            f"print(h.block_digest(h.namespace_digest('tenant-a'), {tokens}).hex())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def digest_in_a_process_with_hash_seed(seed: str) -> str:
        env = {**os.environ, "PYTHONPATH": root, "PYTHONHASHSEED": seed}
        return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True,
                              capture_output=True, text=True, timeout=60).stdout.strip()

    here = block_hash.block_digest(block_hash.namespace_digest("tenant-a"), tokens)
    assert len(here) == block_hash.DIGEST_SIZE == 32
    assert {digest_in_a_process_with_hash_seed(s) for s in ("0", "4242")} == {here.hex()}


# --- growing, fork, copy-on-write ---

def test_decode_takes_a_new_block_every_block_size_tokens():
    bm = make_manager(prefix_caching=False)
    cache = FakeKVCache(bm)
    seq = prefilled(bm, cache, [1, 2, 3])
    sizes = []
    for t in range(9):
        cache.decode(seq, t)
        sizes.append(len(bm.get_block_table(seq)))
    assert sizes == [1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert cache.read(seq) == seq.token_ids


def test_fork_shares_every_block_of_the_parent():
    bm = make_manager()
    cache = FakeKVCache(bm)
    group = make_group(list(range(6)))
    parent = group.first_seq
    cache.prefill(parent)
    free_before = bm.get_num_free_device_blocks()
    child = fork(bm, group, parent)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert [ref_count(bm, i) for i in bm.get_block_table(parent)] == [2, 2]
    assert bm.get_num_free_device_blocks() == free_before


def test_appending_to_a_forked_child_copies_its_shared_last_block():
    bm = make_manager()
    cache = FakeKVCache(bm)
    group = make_group(list(range(6)))
    parent = group.first_seq
    cache.prefill(parent)
    parent_table = list(bm.get_block_table(parent))
    child = fork(bm, group, parent)
    assert bm.can_append_slots(child, 1)
    copies = cache.decode(child, 100)
    child_table = bm.get_block_table(child)
    assert copies == [(parent_table[1], child_table[1])]
    assert child_table[1] != parent_table[1] and child_table[0] == parent_table[0]
    assert bm.get_block_table(parent) == parent_table
    assert [ref_count(bm, i) for i in parent_table] == [2, 1]
    assert cache.decode(parent, 200) == []  # the parent's block is its own again
    assert cache.read(child) == child.token_ids and cache.read(parent) == parent.token_ids


def test_appending_past_a_shared_full_block_needs_no_copy():
    bm = make_manager()
    cache = FakeKVCache(bm)
    group = make_group(list(range(8)))
    cache.prefill(group.first_seq)
    child = fork(bm, group, group.first_seq)
    assert cache.decode(child, 100) == []
    assert len(bm.get_block_table(child)) == 3


def test_can_append_slots_counts_the_copy_of_a_shared_block():
    bm = make_manager(num_device_blocks=2)
    cache = FakeKVCache(bm)
    group = make_group(list(range(6)))  # both blocks, the last one partly filled
    cache.prefill(group.first_seq)
    child = fork(bm, group, group.first_seq)
    child.append_placeholder()
    assert bm.num_blocks_to_append(child, 1) == 1
    assert not bm.can_append_slots(child, 1)


# --- swap ---

def test_swap_out_then_in_restores_every_sequence_and_frees_device_blocks():
    bm = make_manager(num_device_blocks=16, num_cpu_blocks=16)
    cache = FakeKVCache(bm)
    group = make_group(list(range(10)))
    cache.prefill(group.first_seq)
    child = fork(bm, group, group.first_seq)
    cache.decode(child, 100)
    cache.decode(group.first_seq, 200)
    tokens = {s.seq_id: list(s.token_ids) for s in group.seqs}
    assert bm.can_swap_out(group)
    cache.copy(bm.swap_out(group), cache.device, cache.cpu)
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks - 4  # 2 shared + 1 own each
    filler = prefilled(bm, cache, [7] * 16 * BS)  # overwrite every device block
    bm.free(filler)
    assert bm.can_swap_in(group) == AllocStatus.OK
    cache.copy(bm.swap_in(group), cache.cpu, cache.device)
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    for seq in group.seqs:
        assert cache.read(seq) == tokens[seq.seq_id]
    assert bm.get_block_table(child)[:2] == bm.get_block_table(group.first_seq)[:2]


def test_swap_out_moves_a_shared_block_once():
    bm = make_manager()
    cache = FakeKVCache(bm)
    group = make_group(list(range(8)))
    cache.prefill(group.first_seq)
    fork(bm, group, group.first_seq)
    fork(bm, group, group.first_seq)
    copies = bm.swap_out(group)
    assert len(copies) == 2
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks - 2


def test_swap_out_is_refused_when_cpu_blocks_run_out():
    bm = make_manager(num_cpu_blocks=2)
    cache = FakeKVCache(bm)
    group = make_group(list(range(9)))  # 3 blocks
    cache.prefill(group.first_seq)
    assert not bm.can_swap_out(group)
    small = make_group(list(range(100, 108)))
    cache.prefill(small.first_seq)
    assert bm.can_swap_out(small)


def test_swap_in_waits_for_device_blocks():
    bm = make_manager(num_device_blocks=8, num_cpu_blocks=8, prefix_caching=False)
    cache = FakeKVCache(bm)
    group = make_group(list(range(12)))  # 3 full blocks
    cache.prefill(group.first_seq)
    group.first_seq.append_placeholder()  # its next token starts a 4th block
    bm.swap_out(group)
    holder = prefilled(bm, cache, list(range(20)))  # 5 of 8 blocks
    assert bm.can_swap_in(group) == AllocStatus.LATER
    bm.free(holder)
    assert bm.can_swap_in(group) == AllocStatus.OK


def test_swap_in_reserves_only_the_blocks_the_next_chunk_needs():
    bm = make_manager(num_device_blocks=8, num_cpu_blocks=8, prefix_caching=False)
    cache = FakeKVCache(bm)
    group = make_group(list(range(10)))  # 3 blocks, room left in the last one
    cache.prefill(group.first_seq)
    group.first_seq.append_placeholder()
    bm.swap_out(group)
    prefilled(bm, cache, list(range(20)))  # 5 of 8 blocks
    assert bm.can_swap_in(group) == AllocStatus.OK


def test_swap_in_of_a_group_larger_than_the_cache_is_never_possible():
    bm = make_manager(num_device_blocks=4, num_cpu_blocks=8, prefix_caching=False)
    cache = FakeKVCache(bm)
    group = make_group(list(range(16)))  # every device block
    cache.prefill(group.first_seq)
    group.first_seq.append_placeholder()
    bm.swap_out(group)
    assert bm.can_swap_in(group) == AllocStatus.NEVER


def test_a_swapped_out_prefix_stays_cached_on_the_device():
    bm = make_manager()
    cache = FakeKVCache(bm)
    group = make_group(list(range(9)))
    cache.prefill(group.first_seq)
    bm.swap_out(group)
    assert cache.prefill(make_group(list(range(9))).first_seq) == 8


def test_swapped_in_blocks_are_cached_again():
    bm = make_manager(num_device_blocks=8, num_cpu_blocks=8)
    cache = FakeKVCache(bm)
    group = make_group(list(range(9)))
    cache.prefill(group.first_seq)
    cache.copy(bm.swap_out(group), cache.device, cache.cpu)
    bm.free(prefilled(bm, cache, list(range(100, 132))))  # evicts the group's cached blocks
    assert bm.allocate_prefix(make_group(list(range(9))).first_seq) == 0
    cache.copy(bm.swap_in(group), cache.cpu, cache.device)
    probe = make_group(list(range(9))).first_seq
    assert bm.allocate_prefix(probe) == 8
    assert bm.get_block_table(probe) == bm.get_block_table(group.first_seq)[:2]


# --- freeing ---

def test_freeing_an_aborted_group_returns_every_block():
    bm = make_manager()
    cache = FakeKVCache(bm)
    group = make_group(list(range(10)))
    cache.prefill(group.first_seq)
    fork(bm, group, group.first_seq)
    swapped = make_group(list(range(50, 60)))
    cache.prefill(swapped.first_seq)
    bm.swap_out(swapped)
    never_scheduled = make_group([1, 2, 3])
    for g in (group, swapped, never_scheduled):
        for seq in g.seqs:
            bm.free(seq)
            bm.free(seq)  # a second free of the same sequence is a no-op
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    assert all(b.ref_count == 0 for b in bm.device_pool.blocks + bm.cpu_pool.blocks)


def test_a_block_cannot_be_freed_twice():
    bm = make_manager()
    block = bm.device_pool.allocate()
    bm.device_pool.free(block)
    with pytest.raises(AssertionError):
        bm.device_pool.free(block)


# --- randomized: every operation keeps the books, and the cache contents, right ---

def check_books(bm: BlockManager, cache: FakeKVCache, on_device: list[Sequence]) -> None:
    holders = {}
    for seq in on_device:
        assert cache.read(seq) == seq.token_ids[:seq.num_computed_tokens]
        for block_id in bm.get_block_table(seq):
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in bm.device_pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert bm.num_device_blocks - bm.get_num_free_device_blocks() == len(holders)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_blocks_balance_to_zero_after_random_operations(prefix_caching, seed):
    rng = random.Random(seed)
    bm = make_manager(num_device_blocks=24, num_cpu_blocks=12, prefix_caching=prefix_caching)
    cache = FakeKVCache(bm)
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    groups: list[SequenceGroup] = []
    swapped: set[str] = set()

    def running_seqs():
        return [s for g in groups if g.request_id not in swapped for s in g.unfinished_seqs()]

    for _ in range(300):
        op = rng.choice(["add", "decode", "decode", "fork", "swap_out", "swap_in", "free"])
        running = running_seqs()
        if op == "add":
            prompt = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
            group = make_group(prompt)
            if bm.can_allocate(group, len(prompt)) == AllocStatus.OK:
                seq = group.first_seq
                seq.num_computed_tokens = bm.allocate_prefix(seq)
                assert bm.can_append_slots(seq, len(seq) - seq.num_computed_tokens)
                cache.schedule(seq, len(seq) - seq.num_computed_tokens)
                groups.append(group)
        elif op == "decode" and running:
            seq = rng.choice(running)
            seq.append_placeholder()
            if bm.can_append_slots(seq, 1):
                cache.schedule(seq, 1, sampled=rng.randrange(4))
            else:  # out of blocks: preempt by recompute
                bm.free(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        elif op == "fork" and running:
            parent = rng.choice(running)
            fork(bm, next(g for g in groups if parent in g.seqs), parent)
        elif op == "swap_out" and running:
            victim = rng.choice(running)
            group = next(g for g in groups if victim in g.seqs)
            if bm.can_swap_out(group):
                cache.copy(bm.swap_out(group), cache.device, cache.cpu)
                swapped.add(group.request_id)
        elif op == "swap_in" and swapped:
            request_id = rng.choice(sorted(swapped))
            group = next(g for g in groups if g.request_id == request_id)
            if bm.can_swap_in(group) == AllocStatus.OK:
                cache.copy(bm.swap_in(group), cache.cpu, cache.device)
                swapped.discard(group.request_id)
        elif op == "free" and groups:
            seq = rng.choice([s for g in groups for s in g.unfinished_seqs()] or [None])
            if seq is not None:
                bm.free(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
        check_books(bm, cache, running_seqs())

    for group in groups:
        for seq in group.seqs:
            bm.free(seq)
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    assert all(b.ref_count == 0 for b in bm.device_pool.blocks + bm.cpu_pool.blocks)
