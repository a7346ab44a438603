"""Attention in Triton kernels (pagoda_kernels/triton), the CUDA path: the cache write, decode attention
reading each sequence's blocks in place (split over long contexts), and every prefill of a step
in one varlen launch over the cache. On the CPU the same kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how they are tested here; it is far too slow to serve with.

The profile run (no cache yet) takes the torch reference ops: it measures memory, not speed.

Decode attention splits a context into at most MAX_DECODE_PARTITIONS partitions (512 tokens
each up to 32K tokens, longer ones beyond): a CUDA graph captures decode at the longest context
(services/worker/cuda_graphs.py), and its grid and partial buffers stay that size.
"""
import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend

MAX_DECODE_PARTITIONS = 64


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"

    def __init__(self):
        # Imported here: triton is needed only by a worker that picks this backend.
        from pagoda_kernels.triton import kv_cache, paged_attention, prefill_attention
        self._write = kv_cache.write_kv_cache
        self._decode = paged_attention.paged_decode_attention
        self._prefill = prefill_attention.prefill_attention
        self._partition_size = paged_attention.DEFAULT_PARTITION_SIZE

    def _write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._write(k, v, k_cache, v_cache, slot_mapping)

    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                 scale: float) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale,
                            partition_size=decode_partition_size(max_seq_len,
                                                                 self._partition_size))

    def _prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k_cache is None:
            return super()._prefills(q, k, v, k_cache, v_cache, meta, scale)
        # The step's K/V are in the cache already: whole prompts and chunks after a cached
        # prefix alike read it, so one launch serves every prefill of the step.
        n = meta.num_prefills
        return self._prefill(q, k_cache, v_cache, meta.block_tables[:n],
                             meta.query_start_loc[:n + 1], meta.context_lens[:n],
                             meta.seq_lens[:n], meta.max_query_len,
                             max(meta.seq_lens_list[:n]), scale)


def decode_partition_size(max_seq_len: int, smallest: int) -> int:
    """Tokens per decode partition: `smallest` (a power of two), doubled until at most
    MAX_DECODE_PARTITIONS partitions cover max_seq_len."""
    size = smallest
    while size * MAX_DECODE_PARTITIONS < max_seq_len:
        size *= 2
    return size
