"""How many KV cache blocks fit a GPU after the profile run: pure arithmetic over what the worker
measured, so that it is tested without a GPU.

The worker reads the device's free memory before it loads the model (`free_at_start`), then runs
the largest step the scheduler can produce with no KV cache and reads torch's peak allocation
and the free memory again. The cache gets what is left of `free_at_start * utilization` after
  - torch's peak during the profile (weights, activations, logits, sampler temporaries), and
  - memory that went missing outside torch's own reservation meanwhile: this process's CUDA
    context, cuBLAS and NCCL workspaces, and whatever other processes took since the start.
Memory other processes held before the start is not in `free_at_start` at all.
"""
from dataclasses import dataclass


@dataclass
class ProfileMemory:
    free_at_start: int  # bytes free on the device before the model was loaded
    free_after: int  # bytes free after the profile step
    torch_peak: int  # torch.cuda.max_memory_allocated over load and profile
    torch_reserved: int  # torch.cuda.memory_reserved after the profile (its cache included)


def kv_cache_budget_bytes(m: ProfileMemory, utilization: float) -> int:
    """Bytes the KV cache may take (0 when nothing is left)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    taken_since_start = max(0, m.free_at_start - m.free_after)
    outside_torch = max(0, taken_since_start - m.torch_reserved)
    return max(0, int(m.free_at_start * utilization) - m.torch_peak - outside_torch)


def num_kv_blocks(m: ProfileMemory, utilization: float, block_bytes: int) -> int:
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    return kv_cache_budget_bytes(m, utilization) // block_bytes
