"""Draft-model proposals: a smaller model of the same tokenizer runs k decode steps ahead of the
target for the sequences that speculate.

The draft has a KV cache of its own with the target's block layout: a sequence's block table
addresses both caches, so the scheduler allocates once for the two. The draft's cache is filled
lazily: `SequenceState.num_draft_computed` says how many leading tokens of a sequence have draft
KV, and the first draft pass of a step computes from there (the prompt, the tokens of steps
that did not speculate, the target's last token), like a prefill chunk against its cache.
That catch-up is bounded: a step's first pass computes at most `max_batch_tokens` tokens (the
scheduler's max_num_batched_tokens, which the memory profile runs the draft at), the rows
least behind first; a row that does not catch up within what is left computes a chunk and
proposes nothing this step, and goes on from there the next. After verification only the
accepted proposals' draft KV stays valid.
"""
from dataclasses import dataclass

import torch

from services.worker.attention import get_attn_backend
from services.worker.model_loader import load_model
from services.worker.profile_pass import profile_forward
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
                 block_size: int, max_batch_tokens: int):
        self.model_config = mc = config  # the draft's ModelConfig
        self.device = device
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens  # a step's catch-up, at most
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
        distribution at each proposal [sum of proposals, V], or None when every row is greedy
        (then each proposal is the draft's argmax) or none proposes)."""
        greedy = all(r.params.is_greedy for r in sampling_rows)
        drafts = [_DraftState(list(r.state.token_ids), r.state.block_table) for r in rows]
        computed = [min(r.state.num_draft_computed, len(d.token_ids) - 1)
                    for r, d in zip(rows, drafts)]
        # The first pass's chunks: what each row lacks, within the step's catch-up budget.
        chunks, left = [0] * len(rows), self.max_batch_tokens
        for i in sorted(range(len(rows)), key=lambda i: len(drafts[i].token_ids) - computed[i]):
            if max_tokens[i] > 0:
                chunks[i] = min(len(drafts[i].token_ids) - computed[i], left)
                left -= chunks[i]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        batch_ids = [i for i, n in enumerate(chunks) if n > 0]
        step = 0
        while batch_ids:
            batch = [_DraftRow(_DraftSeq(rows[i].seq.seq_id), drafts[i], computed[i], chunks[i])
                     for i in batch_ids]
            order = sorted(range(len(batch)), key=lambda j: batch[j].num_tokens == 1)
            batch = [batch[j] for j in order]
            batch_ids = [batch_ids[j] for j in order]  # prefill-shaped rows first (prepare's)
            input_ids, positions, meta, _ = prepare_inputs(batch, self.block_size, self.staging)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            ends, active, offset = [], [], 0
            for b, i in zip(batch, batch_ids):
                offset += b.num_tokens
                computed[i] += b.num_tokens
                if computed[i] == len(drafts[i].token_ids):  # caught up: it proposes
                    ends.append(offset - 1)  # its last position: its next token's logits
                    active.append(i)
            if not active:
                break
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
                drafts[i].token_ids.append(tokens[j])
            step += 1
            batch_ids = [i for i in active if step < max_tokens[i]]
            for i in batch_ids:
                chunks[i] = 1
        proposals = []
        for r, d, n in zip(rows, drafts, computed):
            r.state.num_draft_computed = n
            proposals.append(d.token_ids[len(r.state.token_ids):])
        if greedy or not any(probs):
            return proposals, None
        return proposals, torch.stack([q for row_probs in probs for q in row_probs])

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_rows: int, k: int) -> torch.Tensor | None:
        """The draft's largest pass (a catch-up of `num_tokens`, at most `max_batch_tokens`),
        logits for `num_rows`; -> a tensor the size of the k distributions per row a step
        keeps for verification (None on no logits)."""
        logits = profile_forward(self.model, min(num_tokens, self.max_batch_tokens), num_rows,
                                 self.device, self.block_size)
        if logits is None:
            return None
        logits.float().softmax(dim=-1)
        return torch.empty(num_rows * k, logits.shape[-1], device=self.device)


def _draft_row(row: SamplingRow, step: int) -> SamplingRow:
    return SamplingRow(row.params, row.seed ^ _DRAFT_SEED_SALT, row.sample_index,
                       row.output_index + step, [], [])
