"""Speculative decoding in the worker: proposals after the decodes that the engine reserved
lookahead slots for, and their verification once the target has computed them.

The ModelRunner calls `propose` while it plans a step's rows (a row with proposals computes
them after its token, like a prefill chunk), `verify` on the target's hidden states at those
rows, and `drop_lookahead_blocks` at the end of a step that had lookahead slots.
"""
import torch

from proto.messages import SamplerOutput
from shared.config import LoadConfig, PagodaConfig
from services.worker.ngram_proposer import NgramProposer
from services.worker.rejection_sampler import rejection_sample
from services.worker.sampling_metadata import SamplingRow


class SpecDecoder:
    def __init__(self, config: PagodaConfig):
        self.config = config
        spec = self.spec = config.speculative_config
        # N-gram lookup, or a draft model (`load_draft`, with the target).
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max)
                         if spec.method == "ngram" else None)
        self.draft = None  # DraftProposer
        self._draft_probs = None  # this step's draft distributions, per proposal
        self._proposing_rows = []

    def load_draft(self) -> None:
        if self.spec.method != "draft_model":
            return
        from services.worker.draft_proposer import DraftProposer
        c = self.config
        self.draft = DraftProposer(self.spec.draft_model_config, c.device_config.device,
                                   LoadConfig("auto"), c.device_config.attention_backend,
                                   c.cache_config.block_size,
                                   c.scheduler_config.max_num_batched_tokens)

    def propose(self, rows: list) -> list:
        """Proposals after each decode's token (ModelRunner rows), appended to its sequence
        for this step's inputs (`verify` keeps the accepted ones); a row without any stays a
        decode."""
        self._draft_probs = None
        self._proposing_rows = rows
        if not rows:
            return rows
        for row in rows:
            assert row.num_tokens == 1 and row.group.do_sample and row.start + 1 == len(
                row.state.token_ids), f"seq {row.seq.seq_id}: lookahead slots on no decode"
        limits = [row.group.num_lookahead_slots for row in rows]
        if self.draft is not None:
            proposals, self._draft_probs = self.draft.propose(
                rows, limits, [sampling_row(row) for row in rows])
        else:
            proposals = [self.proposer.propose(row.state.token_ids, k)
                         for row, k in zip(rows, limits)]
        for row, props in zip(rows, proposals):
            if props:
                row.proposals = props
                row.num_tokens += len(props)
                row.state.token_ids.extend(props)
        return rows

    def verify(self, logits: torch.Tensor, rows: list, out: SamplerOutput) -> None:
        """Accept or reject each row's proposals (rejection_sampler.py) given the target's
        logits at every position of the rows (in order), and keep what they emit: the accepted
        proposals and one token of the target's."""
        draft_probs = self._draft_probs
        if draft_probs is not None:
            # The draft's distributions are in proposing order: put them in verifying order.
            by_row, offset = {}, 0
            for row in self._proposing_rows:
                if row.proposals:
                    by_row[id(row)] = range(offset, offset + len(row.proposals))
                    offset += len(row.proposals)
            draft_probs = draft_probs[[i for row in rows for i in by_row[id(row)]]]
        verified = rejection_sample(logits, [r.proposals for r in rows],
                                    [sampling_row(r) for r in rows], draft_probs)
        for row, tokens, logprobs in zip(rows, verified.token_ids, verified.logprobs):
            del row.state.token_ids[row.start + 1:]
            row.state.token_ids.extend(tokens)
            # Draft KV stays valid for the last token and the accepted proposals only.
            row.state.num_draft_computed = min(row.state.num_draft_computed,
                                               row.start + len(tokens))
            out.seq_ids.append(row.seq.seq_id)
            out.token_ids.append(tokens[0])
            out.logprobs.append(logprobs[0])
            out.top_token_ids.append([])
            out.top_logprobs.append([])
            out.extra_token_ids.append(tokens[1:])
            out.extra_logprobs.append(logprobs[1:])
            out.num_proposed.append(len(row.proposals))

    def drop_lookahead_blocks(self, rows: list) -> None:
        """The engine frees the blocks of a speculating sequence past those its tokens need
        (BlockManager.free_lookahead); the block table here follows."""
        bs = self.config.cache_config.block_size
        for row in rows:
            if row.group.num_lookahead_slots:
                del row.state.block_table[-(len(row.state.token_ids) // -bs):]

    def profile_draft(self, num_tokens: int, num_rows: int) -> torch.Tensor | None:
        """The draft's share of the memory profile (ModelRunner.profile_run): its largest pass
        runs now; the returned tensor is as large as the distributions a step holds while the
        target runs (None without a draft)."""
        if self.draft is None:
            return None
        rows = max(1, min(num_rows, self.spec.disable_by_batch_size))
        return self.draft.profile_run(num_tokens, rows, self.spec.num_speculative_tokens)


def sampling_row(row) -> SamplingRow:
    """A decode's sampling row at its next token (no penalties: such rows never speculate)."""
    req = row.state.request
    return SamplingRow(params=req.params, seed=req.seed, sample_index=row.state.sample_index,
                       output_index=row.start + 1 - req.prompt_len, prompt_token_ids=[],
                       output_token_ids=[])
