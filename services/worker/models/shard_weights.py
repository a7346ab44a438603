"""The slice of each checkpoint tensor that one tensor-parallel rank holds (which slice:
shared/tensor_parallel.py). q/k/v and gate/up are column-parallel (rows of the Hugging Face
tensor), o and down row-parallel (its columns; their outputs are summed over the ranks, so a
bias is added by the leader only). Each rank embeds the ids of its vocabulary rows (zeros for
the others, then summed) and computes the logits of those rows, which the leader gathers.
Norms are replicated.
"""
import torch

from shared.tensor_parallel import TensorParallelShard


def shard_tensor(hf_name: str, tensor: torch.Tensor, shard: TensorParallelShard,
                 head_dim: int) -> torch.Tensor:
    """The part of the Hugging Face tensor `hf_name` that `shard`'s rank holds."""
    if shard.world_size == 1:
        return tensor
    module, kind = hf_name.rsplit(".", 2)[-2:]
    row_parallel = module in ("o_proj", "down_proj")
    if row_parallel and kind == "bias":
        # Added once after the sum over the ranks: held by the leader, zeros elsewhere.
        return tensor if shard.rank == 0 else torch.zeros_like(tensor)
    ranges = {"q_proj": _scaled(shard.heads, head_dim), "k_proj": _scaled(shard.kv_heads, head_dim),
              "v_proj": _scaled(shard.kv_heads, head_dim), "o_proj": _scaled(shard.heads, head_dim),
              "gate_proj": shard.intermediate, "up_proj": shard.intermediate,
              "down_proj": shard.intermediate}
    if module in ranges:
        start, end = ranges[module]
        return tensor.narrow(int(row_parallel), start, end - start)
    if module in ("embed_tokens", "lm_head"):
        start, end = shard.vocab
        part = tensor[start:min(end, tensor.shape[0])]
        if part.shape[0] < shard.vocab_rows:  # the padding rows past the vocabulary
            pad = part.new_zeros(shard.vocab_rows - part.shape[0], *part.shape[1:])
            part = torch.cat([part, pad])
        return part
    return tensor  # norms: replicated


def _scaled(heads: tuple[int, int], head_dim: int) -> tuple[int, int]:
    return heads[0] * head_dim, heads[1] * head_dim
