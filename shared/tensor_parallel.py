"""How a Llama-family model is split over a tensor-parallel group: which heads, MLP columns
and vocabulary rows each rank holds.

- Attention is split by KV head, each rank taking the query heads of its own KV heads, so that
  grouped-query attention runs per rank exactly as it does unsplit. When the KV heads do not
  divide evenly (SmolLM2-135M: 3 KV heads of 3 query heads each), the first ranks take one
  more; with fewer KV heads than ranks each KV head is replicated on the ranks that share its
  query heads.
- The MLP's intermediate dimension is split as evenly as it goes.
- The vocabulary is padded to a multiple of the group's size and split into equal row ranges.

The engine's config checks that a model splits (`shard_for` for every rank); the worker loads
its rank's slices (services/worker/models/shard_weights.py).
"""
from dataclasses import dataclass

from shared.config import ConfigError


@dataclass(frozen=True)
class TensorParallelShard:
    rank: int
    world_size: int
    heads: tuple[int, int]  # [start, end) of this rank's query heads
    kv_heads: tuple[int, int]  # [start, end) of its KV heads
    intermediate: tuple[int, int]  # [start, end) of its MLP columns
    vocab: tuple[int, int]  # [start, end) of its rows of the padded vocabulary
    vocab_size: int  # the model's, unpadded

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]


def _even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` of n items in `parts` contiguous parts, the first
    n % parts of them one item larger."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_for(hf_config, rank: int = 0, world_size: int = 1) -> TensorParallelShard:
    """This rank's part of the model; ConfigError (field tensor_parallel_size) when the model
    cannot be split that many ways."""
    c = hf_config
    num_heads = c.num_attention_heads
    num_kv_heads = getattr(c, "num_key_value_heads", None) or num_heads
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world_size:
        kv = _even_split(num_kv_heads, world_size, rank)
        heads = (kv[0] * group, kv[1] * group)
    else:
        # Each KV head serves world_size / num_kv_heads ranks, which split its query heads.
        if world_size % num_kv_heads or group % (world_size // num_kv_heads):
            raise ConfigError("tensor_parallel_size",
                              f"{world_size} ranks cannot share the model's {num_kv_heads} KV "
                              f"heads of {group} query heads each evenly")
        ranks_per_kv = world_size // num_kv_heads
        kv_index = rank // ranks_per_kv
        per_rank = group // ranks_per_kv
        first = kv_index * group + (rank % ranks_per_kv) * per_rank
        kv, heads = (kv_index, kv_index + 1), (first, first + per_rank)
    if c.intermediate_size < world_size:
        raise ConfigError("tensor_parallel_size", f"{world_size} ranks for an MLP of "
                                                  f"{c.intermediate_size} columns")
    rows = -(-c.vocab_size // world_size)  # padded vocabulary / world_size
    return TensorParallelShard(rank, world_size, heads, kv,
                               _even_split(c.intermediate_size, world_size, rank),
                               (rank * rows, (rank + 1) * rows), c.vocab_size)
