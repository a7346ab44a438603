"""Draft-model proposals: a smaller model of the same tokenizer runs k decode steps ahead of the
target for the sequences that speculate.

The draft has a KV cache of its own with the target's block layout: a sequence's block table
addresses both caches, so the scheduler allocates once for the two. The draft's cache is filled
lazily: `SequenceState.num_draft_computed` says how many leading tokens of a sequence have draft
KV, and the first draft pass of a step computes from there (the prompt, the tokens of steps
that did not speculate, the target's last token), like a prefill chunk against its cache.
After verification only the accepted proposals' draft KV stays valid.
"""
from dataclasses import dataclass

import torch

from services.worker.attention import get_attn_backend
from services.worker.model_loader import load_model
from services.worker.sampler import exponential_race, filter_scores
from services.worker.sampling_metadata import SamplingRow, SamplingTensors
from services.worker.staging import StagingBuffer
from services.worker.step_inputs import prepare_inputs
from shared.tensor_parallel import shard_for

_DRAFT_SEED_SALT = 0x3C6EF372  # the draft's draws: a stream apart from the target's


@dataclass
class _DraftState:
    token_ids: list[int]
    block_table: list[int]


@dataclass
class _DraftSeq:
    seq_id: int


@dataclass
class _DraftRow:
    """What step_inputs.prepare_inputs reads of a row."""
    seq: _DraftSeq
    state: _DraftState
    start: int
    num_tokens: int


class DraftProposer:
    def __init__(self, config, device: torch.device, load_config, attention_backend: str,
                 block_size: int):
        self.model_config = mc = config  # the draft's ModelConfig
        self.device = device
        self.block_size = block_size
        shard = shard_for(mc.hf_config)
        self.attn_backend = get_attn_backend(
            attention_backend, dtype=mc.dtype, device=device, num_heads=shard.num_heads,
            num_kv_heads=shard.num_kv_heads, head_dim=mc.head_dim, block_size=block_size)
        self.num_kv_heads = shard.num_kv_heads
        self.model = load_model(mc, load_config, device, self.attn_backend, shard, None)
        self.kv_caches = None  # set with the target's cache (Worker.initialize_cache)
        # Its own staging buffer: the target's may still be copying this step's inputs.
        self.staging = StagingBuffer(device) if device.type == "cuda" else None

    @torch.inference_mode()
    def propose(self, rows, max_tokens: list[int], sampling_rows: list[SamplingRow]
                ) -> tuple[list[list[int]], torch.Tensor | None]:
        """rows: the ModelRunner's decode rows that may speculate (their `state` is a
        SequenceState); up to max_tokens[i] proposals each. -> (proposals per row, the draft's
        distribution at each proposal [sum of proposals, V], or None when every row is greedy:
        then each proposal is the draft's argmax)."""
        greedy = all(r.params.is_greedy for r in sampling_rows)
        drafts = [_DraftState(list(r.state.token_ids), r.state.block_table) for r in rows]
        computed = [min(r.state.num_draft_computed, len(d.token_ids) - 1)
                    for r, d in zip(rows, drafts)]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = [i for i, k in enumerate(max_tokens) if k > 0]
        step = 0
        while active:
            batch = [_DraftRow(_DraftSeq(rows[i].seq.seq_id), drafts[i], computed[i],
                               len(drafts[i].token_ids) - computed[i]) for i in active]
            order = sorted(range(len(batch)), key=lambda j: batch[j].num_tokens == 1)
            batch = [batch[j] for j in order]
            active = [active[j] for j in order]  # prefill-shaped rows first, as prepare wants
            input_ids, positions, meta = prepare_inputs(batch, self.block_size, self.staging)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            ends, offset = [], 0  # each row's last position: its next token's logits
            for b in batch:
                offset += b.num_tokens
                ends.append(offset - 1)
            logits = self.model.compute_logits(hidden[ends]).float()
            if greedy:
                tokens = logits.argmax(dim=-1).tolist()
            else:
                t = SamplingTensors.from_rows(
                    [_draft_row(sampling_rows[i], step) for i in active], logits.shape[1],
                    logits.device)
                x = filter_scores(logits, t)
                q = x.softmax(dim=-1)
                tokens = torch.where(t.is_greedy, logits.argmax(dim=-1),
                                     exponential_race(x, t)).tolist()
                for j, i in enumerate(active):
                    probs[i].append(q[j])
            for j, i in enumerate(active):
                computed[i] = len(drafts[i].token_ids)
                drafts[i].token_ids.append(tokens[j])
            step += 1
            active = [i for i in active if step < max_tokens[i]]
        proposals = []
        for r, d, n in zip(rows, drafts, computed):
            r.state.num_draft_computed = n
            proposals.append(d.token_ids[len(r.state.token_ids):])
        if greedy:
            return proposals, None
        return proposals, torch.stack([q for row_probs in probs for q in row_probs])


def _draft_row(row: SamplingRow, step: int) -> SamplingRow:
    return SamplingRow(row.params, row.seed ^ _DRAFT_SEED_SALT, row.sample_index,
                       row.output_index + step, [], [])
