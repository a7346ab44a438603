"""BlockPool: the physical blocks of one cache (device or CPU), their reference counts, the free
list, and — for the device cache with prefix caching — the map of cached full blocks and the LRU
of cached blocks that no sequence holds any more."""
from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    digest: bytes | None = None  # set while the block is in the prefix cache: see block_hash


class BlockPool:
    """Blocks 0..num_blocks-1 of one cache. Fresh blocks come from the uncached free list first, and
    only then by evicting the least recently freed cached block, so cached prefixes live as long
    as the memory allows."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[Block] = deque(self.blocks)
        self._free_cached: OrderedDict[int, Block] = OrderedDict()  # block id -> block, oldest first
        self._cached: dict[bytes, Block] = {}  # digest -> block, every cached block, held or free

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def allocate(self) -> Block:
        if self._free_uncached:
            block = self._free_uncached.popleft()
        else:
            assert self._free_cached, "no free block: check can_allocate / can_append_slots first"
            _, block = self._free_cached.popitem(last=False)  # least recently used
            del self._cached[block.digest]
            block.digest = None
        assert block.ref_count == 0, f"block {block.block_id} reused while held"
        block.ref_count = 1
        return block

    def free(self, block: Block) -> None:
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.digest is not None:
                self._free_cached[block.block_id] = block  # most recently used end
            else:
                self._free_uncached.append(block)

    def lookup(self, digest: bytes) -> Block | None:
        return self._cached.get(digest)

    def hold(self, block: Block) -> None:
        """One more holder of a block that is already in use or cached-but-free (revived)."""
        if block.ref_count == 0:
            assert block.digest is not None, f"block {block.block_id} is free and uncached"
            del self._free_cached[block.block_id]
        block.ref_count += 1

    def register(self, block: Block, digest: bytes) -> None:
        """Make a held, full block findable by its digest. If an identical block is already
        cached (two sequences computed the same prefix at the same time), the first one stays the
        cached copy and this one stays private. A block already cached under this digest (a fork
        shares it, and its holders learn of it at different times) stays as it is."""
        assert block.ref_count > 0
        if block.digest is not None:
            assert block.digest == digest, f"block {block.block_id} cached under another digest"
            return
        if digest not in self._cached:
            block.digest = digest
            self._cached[digest] = block

    def reset_cache(self) -> bool:
        """Forget every cached block; refused while any block is held."""
        if self.num_free != self.num_blocks:
            return False
        for block in self._free_cached.values():
            block.digest = None
            self._free_uncached.append(block)
        self._free_cached.clear()
        self._cached.clear()
        return True
