"""Attention in plain torch on the paged KV cache (CPU, and GPU without Triton)."""
import itertools

import torch

from pagoda_kernels.reference import (causal_prefill_attention, paged_decode_attention,
                               prefill_attention, write_kv_cache)
from services.worker.attention.base import AttentionBackend, AttentionMetadata


def padding_pays(query_lens: list[int], seq_lens: list[int]) -> bool:
    """Whether one padded batch beats a call per sequence: padding costs up to
    num_seqs * max_query * max_seq score entries, and a call per sequence has its own overhead
    (measured on the CPU: padded wins for similar lengths, loses for one long prompt among short
    ones)."""
    padded = len(query_lens) * max(query_lens) * max(seq_lens)
    exact = sum(q * s for q, s in zip(query_lens, seq_lens))
    return padded <= 2 * exact


def prefill_calls(query_lens: list[int], seq_lens: list[int],
                  cached: bool) -> list[tuple[int, int, bool]]:
    """How a step's prefills [0, n) are split into attention calls: (first, last, whole) for
    sequences first..last-1. Whole prompts (nothing cached before them, or no cache at all)
    attend to the step's own K/V; chunks after a cached prefix read the cache, which costs a
    gather, so the two kinds never share a call (a chunked prompt's second part beside fresh
    prompts is the common mixed step). Each run of one kind is one padded call if padding pays,
    else a call per sequence."""
    calls = []
    first = 0
    while first < len(query_lens):
        whole = not cached or query_lens[first] == seq_lens[first]
        last = first + 1
        while last < len(query_lens) and (
                not cached or query_lens[last] == seq_lens[last]) == whole:
            last += 1
        if padding_pays(query_lens[first:last], seq_lens[first:last]):
            calls.append((first, last, whole))
        else:
            calls.extend((s, s + 1, whole) for s in range(first, last))
        first = last
    return calls


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if k_cache is None:
            # Profile run: prompts only, nothing cached.
            assert meta.num_decode_tokens == 0
            return self._prefills(q, k, v, None, None, meta, scale)
        self._write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        num_prefill_tokens = meta.num_prefill_tokens
        if not meta.num_decode_tokens:
            return self._prefills(q, k, v, k_cache, v_cache, meta, scale)
        num_prefills = meta.num_prefills
        decode_out = self._decodes(q[num_prefill_tokens:], k_cache, v_cache,
                                   meta.block_tables[num_prefills:], meta.seq_lens[num_prefills:],
                                   max(meta.seq_lens_list[num_prefills:]), scale)
        if not num_prefills:
            return decode_out
        prefill_out = self._prefills(q[:num_prefill_tokens], k[:num_prefill_tokens],
                                     v[:num_prefill_tokens], k_cache, v_cache, meta, scale)
        return torch.cat((prefill_out, decode_out))

    def _write_kv_cache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's new K and V rows into their cache slots."""
        write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                 scale: float) -> torch.Tensor:
        """Attention of the decoding sequences: one query token each."""
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                                      scale)

    def _prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of the prefill sequences, q/k/v holding only their tokens."""
        num_prefills = meta.num_prefills
        query_lens = meta.query_lens_list[:num_prefills]
        seq_lens = meta.seq_lens_list[:num_prefills]
        starts = list(itertools.accumulate(query_lens, initial=0))
        outs = []
        for first, last, whole in prefill_calls(query_lens, seq_lens, k_cache is not None):
            t0, t1 = starts[first], starts[last]
            query_start_loc = meta.query_start_loc[first:last + 1] - t0
            max_query_len = max(query_lens[first:last])
            if whole:
                # Whole prompts: the step's own K/V are all they attend to, no cache gather.
                outs.append(causal_prefill_attention(q[t0:t1], k[t0:t1], v[t0:t1],
                                                     query_start_loc, max_query_len, scale))
            else:
                outs.append(prefill_attention(
                    q[t0:t1], k_cache, v_cache, meta.block_tables[first:last], query_start_loc,
                    meta.context_lens[first:last], meta.seq_lens[first:last], max_query_len,
                    max(seq_lens[first:last]), scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
