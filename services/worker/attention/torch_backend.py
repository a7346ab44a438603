"""Attention in plain torch on the paged KV cache (CPU, and GPU without Triton)."""
import torch

from kernels.reference import (causal_prefill_attention, paged_decode_attention,
                               prefill_attention, write_kv_cache)
from services.worker.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_prefills = meta.num_prefills
        num_prefill_tokens = meta.num_prefill_tokens
        if k_cache is None:
            # Profile run: prompts only, nothing cached.
            assert meta.num_decode_tokens == 0 and num_prefills == meta.num_seqs
            return causal_prefill_attention(q, k, v, meta.query_start_loc, meta.max_query_len, scale)

        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        prefill_out = decode_out = None
        if num_prefills:
            prefill_lens = meta.seq_lens_list[:num_prefills]
            query_start_loc = meta.query_start_loc[:num_prefills + 1]
            if prefill_lens == meta.query_lens_list[:num_prefills]:
                # Whole prompts: the step's own K/V are all there is to attend to, no gather.
                prefill_out = causal_prefill_attention(
                    q[:num_prefill_tokens], k[:num_prefill_tokens], v[:num_prefill_tokens],
                    query_start_loc, meta.max_query_len, scale)
            else:
                prefill_out = prefill_attention(
                    q[:num_prefill_tokens], k_cache, v_cache, meta.block_tables[:num_prefills],
                    query_start_loc, meta.context_lens[:num_prefills],
                    meta.seq_lens[:num_prefills], meta.max_query_len, max(prefill_lens), scale)
        if meta.num_decode_tokens:
            decode_out = paged_decode_attention(
                q[num_prefill_tokens:], k_cache, v_cache, meta.block_tables[num_prefills:],
                meta.seq_lens[num_prefills:], max(meta.seq_lens_list[num_prefills:]), scale)
        if decode_out is None:
            return prefill_out
        if prefill_out is None:
            return decode_out
        return torch.cat((prefill_out, decode_out))
