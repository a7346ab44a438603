"""The one attention-backend interface and the per-step metadata every backend reads.

A step's tokens are laid out flat: first every prefill sequence's query tokens (a prompt, a
prompt chunk, or a resumed sequence being recomputed), then one token per decoding sequence.
Each sequence attends to all of its tokens in the paged KV cache up to its own position; the
backend first writes this step's K/V into the cache at `slot_mapping`.
"""
import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_prefills: int  # sequences [0, num_prefills) are prefills, the rest decodes
    num_prefill_tokens: int
    num_decode_tokens: int  # == number of decoding sequences
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset per token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, offsets of each sequence's queries
    seq_lens: torch.Tensor  # [num_seqs] int64, tokens in the cache after this step
    context_lens: torch.Tensor  # [num_seqs] int64, tokens in the cache before this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 (never read)
    max_query_len: int  # over prefills (1 when there are none)
    max_seq_len: int  # over all sequences
    block_size: int
    # The same lengths as Python lists, for code that plans on the host without a device sync.
    seq_lens_list: list[int]
    query_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class AttentionBackend(ABC):
    """Writes a layer's new K/V into its paged cache and computes attention for the step."""

    name: str = "abstract"

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim],
        k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim] (None in the profile run,
        where every sequence is a prefill with no cached context) -> [T, num_heads, head_dim]."""


def get_attn_backend(name: str = "torch", *, dtype: torch.dtype = torch.float32,
                     device: torch.device = torch.device("cpu"), num_heads: int = 1,
                     num_kv_heads: int = 1, head_dim: int = 64,
                     block_size: int = 16) -> AttentionBackend:
    """The backend called `name`. "auto" picks the Triton kernels on CUDA when triton is
    installed, the compiled CPU kernels on the CPU where they run for this model (float32 or
    bfloat16, a C compiler present), else the torch reference ops. "triton" on the CPU needs
    Triton's interpreter (TRITON_INTERPRET=1): for tests only."""
    if name == "auto" and device.type == "cuda":
        name = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    if name == "triton":
        from services.worker.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name in ("auto", "cpu"):
        from pagoda_kernels import cpu
        if cpu.supports(dtype, device, num_heads, num_kv_heads, head_dim, block_size):
            from services.worker.attention.cpu_backend import CpuAttentionBackend
            return CpuAttentionBackend()
        if name == "cpu":
            raise ValueError(f"the cpu attention backend cannot run here ({dtype}, {device}, "
                             f"{num_heads}/{num_kv_heads} heads, head_dim {head_dim}, block_size "
                             f"{block_size}): {cpu.unavailable_reason() or 'unsupported shape'}")
        name = "torch"
    if name == "torch":
        from services.worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is unknown (available: auto, torch, cpu, "
                     f"triton)")
