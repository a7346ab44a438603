"""BlockManager: which physical KV-cache blocks each sequence's tokens live in.

Position p of a sequence is slot p % block_size of block table[p // block_size]. Blocks are shared
by reference count: between a parent and its forks (n > 1; copy-on-write when one of them writes
into a shared block), and — with prefix caching — between sequences whose leading full blocks hold
the same tokens in the same cache namespace (the request's `cache_salt`). A full block is known by
its SHA-256 digest over its parent block's digest and its token ids, so equal digests mean equal
prefixes, not just equal blocks: see block_hash.

Contract with the Scheduler:
- `allocate_prefix` is the first allocation of a sequence. It attaches cached blocks and returns how
  many leading tokens are cached; the Scheduler sets `num_computed_tokens` to it and then calls
  `append_slots` for the tokens it schedules. At most (known tokens - 1) // block_size blocks
  are taken from the cache: the last token is always computed because its logits are needed,
  and never computing into a cached block keeps cached blocks read-only.
- `append_slots` is called before `num_computed_tokens` is advanced by the step. It also digests
  (caches) full blocks: a block is cached once all its tokens are scheduled for computation and
  known. With one step in flight the newest token is still a placeholder; its block is cached at
  the first call after the placeholder is filled.
- `can_append_slots` checks one sequence alone; for a group, compare the sum of
  `num_blocks_to_append` over its sequences with the free blocks.
"""
import enum
from dataclasses import dataclass

from services.engine import block_hash
from services.engine.block_pool import Block, BlockPool
from services.engine.sequence import Sequence, SequenceGroup


class AllocStatus(enum.Enum):
    OK = enum.auto()  # can be allocated now
    LATER = enum.auto()  # not enough free blocks now; wait for others to finish
    NEVER = enum.auto()  # more than the whole cache: can never be allocated


@dataclass
class BlockTable:
    """One sequence's blocks, in either the device or the CPU pool."""
    blocks: list[Block]
    block_ids: list[int]  # the same blocks' ids, kept in step so a table read costs nothing
    block_hashes: list[bytes]  # digests of the leading full blocks cached so far
    on_cpu: bool = False


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BlockManager:

    def __init__(self, block_size: int, num_device_blocks: int, num_cpu_blocks: int,
                 enable_prefix_caching: bool, watermark: float = 0.01):
        assert block_size > 0 and num_device_blocks > 0 and num_cpu_blocks >= 0
        assert 0.0 <= watermark < 1.0
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Admissions leave this many blocks free, so running sequences can grow a while before
        # anything has to be preempted.
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.device_pool = BlockPool(num_device_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self._tables: dict[int, BlockTable] = {}  # seq id -> its blocks
        self.num_queried_blocks = 0  # prefix-cache lookups since start, in blocks
        self.num_hit_blocks = 0

    # --- admission of a waiting group ---

    def can_allocate(self, seq_group: SequenceGroup, num_tokens: int) -> AllocStatus:
        seqs = seq_group.unfinished_seqs()
        blocks_per_seq = _cdiv(num_tokens, self.block_size)
        num_required = blocks_per_seq * len(seqs)
        if num_required > self.num_device_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.enable_prefix_caching:
            # Hits that other sequences hold cost no block. Hits that are cached-but-free are
            # counted among the free blocks and are taken out of them, so they still count.
            for seq in seqs:
                hits, _, _ = self._find_cached_prefix(seq)
                num_required -= sum(1 for b in hits[:blocks_per_seq] if b.ref_count > 0)
        if self.device_pool.num_free - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate_prefix(self, seq: Sequence, max_cached_tokens: int | None = None) -> int:
        """`max_cached_tokens` caps the hit (rounded down to whole blocks), e.g. to keep the
        sequences of a group in step: see `get_num_cached_tokens`."""
        assert seq.seq_id not in self._tables, f"seq {seq.seq_id} already has blocks"
        table = BlockTable([], [], [])
        self._tables[seq.seq_id] = table
        if not self.enable_prefix_caching:
            return 0
        hits, hashes, num_queried = self._find_cached_prefix(seq)
        if max_cached_tokens is not None:
            num_hits = min(len(hits), max_cached_tokens // self.block_size)
            hits, hashes = hits[:num_hits], hashes[:num_hits]
        for block in hits:
            self.device_pool.hold(block)
        table.blocks = hits
        table.block_ids = [b.block_id for b in hits]
        table.block_hashes = hashes
        self.num_queried_blocks += num_queried
        self.num_hit_blocks += len(hits)
        return len(hits) * self.block_size

    def get_num_cached_tokens(self, seq: Sequence) -> int:
        """What `allocate_prefix` would return now; holds nothing and counts no lookup."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._find_cached_prefix(seq)[0]) * self.block_size

    def _find_cached_prefix(self, seq: Sequence) -> tuple[list[Block], list[bytes], int]:
        """The cached blocks matching the sequence's leading full blocks (up to the first miss),
        their digests, and how many blocks were eligible for a hit."""
        bs = self.block_size
        # Only known tokens, and the last one is always computed.
        num_eligible = max(0, (self._num_known_tokens(seq) - 1) // bs)
        tokens = seq.token_ids
        hits, hashes = [], []
        parent = block_hash.namespace_digest(seq.cache_salt)
        for i in range(num_eligible):
            digest = block_hash.block_digest(parent, tokens[i * bs:(i + 1) * bs])
            block = self.device_pool.lookup(digest)
            if block is None:
                break
            hits.append(block)
            hashes.append(digest)
            parent = digest
        return hits, hashes, num_eligible

    # --- growing a running sequence ---

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_to_append(seq, num_new_tokens) <= self.device_pool.num_free

    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `append_slots` would take: new ones plus copies of shared ones. Summed over
        forks that share a block, its copy is counted once too many (the last holder writes in
        place), which errs on the safe side."""
        return self._num_blocks_to_append(self._device_table(seq), seq, num_new_tokens)

    def _num_blocks_to_append(self, table: BlockTable, seq: Sequence, num_new_tokens: int) -> int:
        first, end = self._written_block_range(seq, num_new_tokens)
        num_new_blocks = max(0, end - len(table.blocks))
        return num_new_blocks + sum(1 for b in table.blocks[first:end] if b.ref_count > 1)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Cover positions [0, num_computed_tokens + num_new_tokens) with blocks this sequence
        may write. Returns the (src, dst) block copies the worker must do before the step.
        A copy replaces entry num_computed_tokens // block_size of the block table."""
        table = self._device_table(seq)
        first, end = self._written_block_range(seq, num_new_tokens)
        copies = []
        for i in range(first, min(end, len(table.blocks))):
            shared = table.blocks[i]
            if shared.ref_count > 1:  # a fork holds it too: write into a private copy
                own = self.device_pool.allocate()
                self.device_pool.free(shared)
                table.blocks[i] = own
                table.block_ids[i] = own.block_id
                copies.append((shared.block_id, own.block_id))
        while len(table.blocks) < end:
            block = self.device_pool.allocate()
            table.blocks.append(block)
            table.block_ids.append(block.block_id)
        if self.enable_prefix_caching:
            num_ready = min(seq.num_computed_tokens + num_new_tokens, self._num_known_tokens(seq))
            self._cache_full_blocks(seq, table, num_ready // self.block_size)
        return copies

    @staticmethod
    def _num_known_tokens(seq: Sequence) -> int:
        return len(seq) - seq.num_placeholders  # placeholders: samples of a step in flight

    def _written_block_range(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int]:
        start = seq.num_computed_tokens
        return start // self.block_size, _cdiv(start + num_new_tokens, self.block_size)

    def _cache_full_blocks(self, seq: Sequence, table: BlockTable, num_full_blocks: int) -> None:
        # Only the blocks past those already digested: a decode step digests at most one block.
        bs = self.block_size
        hashes = table.block_hashes
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else block_hash.namespace_digest(seq.cache_salt)
            digest = block_hash.block_digest(parent, seq.token_ids[i * bs:(i + 1) * bs])
            self.device_pool.register(table.blocks[i], digest)
            hashes.append(digest)

    def free_lookahead(self, seq: Sequence) -> int:
        """After a speculative step: drop the blocks past those that the sequence's tokens
        need (slots reserved for proposals that were rejected). They were never full of known
        tokens, so never cached. The worker drops the same entries of its table. Returns how
        many blocks were freed."""
        table = self._device_table(seq)
        keep = _cdiv(len(seq), self.block_size)
        extra = table.blocks[keep:]
        for block in reversed(extra):
            assert block.digest is None, f"lookahead block {block.block_id} is cached"
            self.device_pool.free(block)
        del table.blocks[keep:], table.block_ids[keep:]
        return len(extra)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        # The child caches its own later blocks, and after a recompute its prefix, in its salt's
        # namespace: it must be the parent's.
        assert child.cache_salt == parent.cache_salt, f"seq {child.seq_id} forked with another salt"
        src = self._device_table(parent)
        assert child.seq_id not in self._tables, f"seq {child.seq_id} already has blocks"
        for block in src.blocks:
            self.device_pool.hold(block)
        self._tables[child.seq_id] = BlockTable(
            list(src.blocks), list(src.block_ids), list(src.block_hashes))

    def free(self, seq: Sequence) -> None:
        """Drop a sequence's blocks. A sequence that holds none (never scheduled, or already freed)
        is a no-op, so aborting needs no bookkeeping of where a sequence is."""
        table = self._tables.pop(seq.seq_id, None)
        if table is None:
            return
        pool = self.cpu_pool if table.on_cpu else self.device_pool
        # Tail first: the LRU then evicts a prefix's tail before its head, which more
        # requests share.
        for block in reversed(table.blocks):
            pool.free(block)

    # --- swap ---

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        return len(self._distinct_blocks(seq_group, on_cpu=False)) <= self.cpu_pool.num_free

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks to CPU blocks; returns (device_block, cpu_block) copies."""
        return self._move(self._seqs_holding(seq_group, on_cpu=False), to_cpu=True)

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        # Room for the next chunk too: the group is scheduled right after it comes back. CPU ref
        # counts are the group's own sharing, which the device blocks will have.
        num_required = len(self._distinct_blocks(seq_group, on_cpu=True)) + sum(
            self._num_blocks_to_append(self._tables[s.seq_id], s, s.num_uncomputed_tokens)
            for s in self._seqs_holding(seq_group, on_cpu=True))
        if num_required > self.num_device_blocks:
            return AllocStatus.NEVER
        if self.device_pool.num_free - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's blocks back to fresh device blocks; returns (cpu_block, device_block)
        copies. Blocks that were cached before the swap are cached again (unless an identical
        block was cached meanwhile)."""
        seqs = self._seqs_holding(seq_group, on_cpu=True)
        copies = self._move(seqs, to_cpu=False)
        if self.enable_prefix_caching:
            for seq in seqs:
                table = self._tables[seq.seq_id]
                num_cached = len(table.block_hashes)
                table.block_hashes = []
                self._cache_full_blocks(seq, table, num_cached)
        return copies

    def _seqs_holding(self, seq_group: SequenceGroup, on_cpu: bool) -> list[Sequence]:
        return [s for s in seq_group.unfinished_seqs()
                if s.seq_id in self._tables and self._tables[s.seq_id].on_cpu == on_cpu]

    def _distinct_blocks(self, seq_group: SequenceGroup, on_cpu: bool) -> set[int]:
        return {b for s in self._seqs_holding(seq_group, on_cpu)
                for b in self._tables[s.seq_id].block_ids}

    def _move(self, seqs: list[Sequence], to_cpu: bool) -> list[tuple[int, int]]:
        src_pool, dst_pool = ((self.device_pool, self.cpu_pool) if to_cpu
                              else (self.cpu_pool, self.device_pool))
        moved: dict[int, Block] = {}  # src block id -> its copy; a shared block moves once
        for seq in seqs:
            table = self._tables[seq.seq_id]
            new_blocks = []
            for block in table.blocks:
                copy = moved.get(block.block_id)
                if copy is None:
                    copy = moved[block.block_id] = dst_pool.allocate()
                else:
                    dst_pool.hold(copy)
                new_blocks.append(copy)
            for block in reversed(table.blocks):
                src_pool.free(block)
            table.blocks = new_blocks
            table.block_ids = [b.block_id for b in new_blocks]
            table.on_cpu = to_cpu
        return [(src_id, copy.block_id) for src_id, copy in moved.items()]

    # --- queries ---

    def get_block_table(self, seq: Sequence) -> list[int]:
        """Physical device block ids. This is the live list (no copy per step): read it, slice it,
        never mutate or keep it."""
        return self._device_table(seq).block_ids

    def _device_table(self, seq: Sequence) -> BlockTable:
        table = self._tables[seq.seq_id]
        assert not table.on_cpu, f"seq {seq.seq_id} is swapped out"
        return table

    def get_num_free_device_blocks(self) -> int:
        return self.device_pool.num_free

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.device_pool.num_free / self.num_device_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_queried_blocks if self.num_queried_blocks else 0.0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing forgotten) while any block is held."""
        return self.device_pool.reset_cache()
