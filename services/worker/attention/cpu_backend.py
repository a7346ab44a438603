"""The torch backend with the CPU's attention in compiled kernels (pagoda_kernels/cpu): decode attention
reads each sequence's K/V blocks in place instead of gathering them into a copy, the cache write
is one C call, and whole prompts (nothing cached before them) run causal prefill attention on
the step's own K/V, all of a run's sequences in one call with no padding. Prompt chunks after a
cached prefix keep the torch op, which gathers the cache; so does everything the prefill kernel
does not run (head_dim other than 64 and 128), and every prompt where the kernels have no vector
loop for it (their portable loop is slower than torch's SDPA)."""
import itertools

import torch

from pagoda_kernels import reference
from pagoda_kernels.cpu import (causal_prefill_attention, causal_prefill_supports,
                                paged_decode_attention, prefill_simd_path, write_kv_cache)
from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend, prefill_calls


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

    def _prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not (prefill_simd_path() and causal_prefill_supports(q.dtype, q.device, q.shape[1],
                                                                k.shape[1], q.shape[2])):
            return super()._prefills(q, k, v, k_cache, v_cache, meta, scale)
        n = meta.num_prefills
        query_lens = meta.query_lens_list[:n]
        seq_lens = meta.seq_lens_list[:n]
        whole = [k_cache is None or ql == sl for ql, sl in zip(query_lens, seq_lens)]
        starts = list(itertools.accumulate(query_lens, initial=0))
        outs = []
        # Runs of one kind in step order: whole prompts in one kernel call each run; chunks
        # over a cached prefix split as the torch backend splits them (padding where it pays).
        for kind, run in itertools.groupby(range(n), key=lambda s: whole[s]):
            run = list(run)
            first, last = run[0], run[-1] + 1
            t0, t1 = starts[first], starts[last]
            if kind:
                outs.append(causal_prefill_attention(
                    q[t0:t1], k[t0:t1], v[t0:t1], meta.query_start_loc[first:last + 1] - t0,
                    max(query_lens[first:last]), scale))
                continue
            for a, b, _ in prefill_calls(query_lens[first:last], seq_lens[first:last], True):
                a, b = first + a, first + b
                outs.append(reference.prefill_attention(
                    q[starts[a]:starts[b]], k_cache, v_cache, meta.block_tables[a:b],
                    meta.query_start_loc[a:b + 1] - starts[a], meta.context_lens[a:b],
                    meta.seq_lens[a:b], max(query_lens[a:b]), max(seq_lens[a:b]), scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
