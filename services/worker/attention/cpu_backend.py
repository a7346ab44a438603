"""The torch backend with decode attention in the compiled CPU kernel (kernels/cpu), which
reads each sequence's K/V blocks in place instead of gathering them into a copy, and the cache
write in one C call. Prefills keep the torch ops: their attention is a large matmul that SDPA
already runs well."""
import torch

from kernels.cpu import paged_decode_attention, write_kv_cache
from services.worker.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def _write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                 scale: float) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                                      scale)
