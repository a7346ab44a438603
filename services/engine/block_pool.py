"""BlockPool: the physical blocks of one cache (device or CPU), their reference counts, the free
list, and — for the device cache with prefix caching — the map of cached full blocks and the LRU
of cached blocks that no sequence holds any more."""
from collections import OrderedDict, deque
from dataclasses import dataclass

# A cached block is found by its key: (parent block's hash, its token ids...). The key, not only its
# hash, is what the map compares, so two different prefixes never share a block even if their
# hashes collide. The first block of a sequence has no parent; hash() never returns -1.
BlockKey = tuple[int, ...]
NO_PARENT_HASH = -1


def block_key(parent_hash: int, token_ids: list[int]) -> BlockKey:
    return (parent_hash, *token_ids)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set while the block is in the prefix cache


class BlockPool:
    """Blocks 0..num_blocks-1 of one cache. Fresh blocks come from the uncached free list first, and
    only then by evicting the least recently freed cached block, so cached prefixes live as long
    as the memory allows."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[Block] = deque(self.blocks)
        self._free_cached: OrderedDict[int, Block] = OrderedDict()  # block id -> block, oldest first
        self._cached: dict[BlockKey, Block] = {}  # every cached block, held or free

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def allocate(self) -> Block:
        if self._free_uncached:
            block = self._free_uncached.popleft()
        else:
            assert self._free_cached, "no free block: check can_allocate / can_append_slots first"
            _, block = self._free_cached.popitem(last=False)  # least recently used
            del self._cached[block.key]
            block.key = None
        assert block.ref_count == 0, f"block {block.block_id} reused while held"
        block.ref_count = 1
        return block

    def free(self, block: Block) -> None:
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.key is not None:
                self._free_cached[block.block_id] = block  # most recently used end
            else:
                self._free_uncached.append(block)

    def lookup(self, key: BlockKey) -> Block | None:
        return self._cached.get(key)

    def hold(self, block: Block) -> None:
        """One more holder of a block that is already in use or cached-but-free (revived)."""
        if block.ref_count == 0:
            assert block.key is not None, f"block {block.block_id} is free and uncached"
            del self._free_cached[block.block_id]
        block.ref_count += 1

    def register(self, block: Block, key: BlockKey) -> None:
        """Make a held, full block findable by its key. If an identical block is already cached
        (two sequences computed the same prefix at the same time), the first one stays the
        cached copy and this one stays private. A block already cached under this key (a fork
        shares it, and its holders learn of it at different times) stays as it is."""
        assert block.ref_count > 0
        if block.key is not None:
            assert block.key == key, f"block {block.block_id} cached under another key"
            return
        if key not in self._cached:
            block.key = key
            self._cached[key] = block

    def reset_cache(self) -> bool:
        """Forget every cached block; refused while any block is held."""
        if self.num_free != self.num_blocks:
            return False
        for block in self._free_cached.values():
            block.key = None
            self._free_uncached.append(block)
        self._free_cached.clear()
        self._cached.clear()
        return True
