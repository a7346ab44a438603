"""Verification of speculative proposals: which proposed tokens the target model accepts, and
the token it adds after them.

A sequence that proposed d_1..d_p gets target logits at p + 1 positions (its last token and
each proposal). Walking the positions in order:
- greedy requests accept d_j while it is the target's argmax, then take the argmax; so the
  output is the one plain greedy decoding gives;
- sampled requests accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), where p_j is the
  target's distribution after temperature and filters, and q_j the proposer's (a point mass for
  n-gram lookup: accept with probability p_j(d_j)). At the first rejection they draw from
  normalize(max(0, p_j - q_j)) instead, which leaves every emitted token distributed as the
  target alone would draw it.
When every proposal is accepted, the last position's distribution gives one more (bonus) token.

Randomness is counter-based like the sampler's: position j of a sequence whose output holds o
tokens uses the noise of output index o + j, so a seeded request gives the same tokens for the
same proposals whatever the batch.
"""
from dataclasses import dataclass

import torch

from services.worker.sampler import (exponential_race, filter_scores, mix32, noise_keys,
                                     uniform_noise)
from services.worker.sampling_metadata import SamplingRow, SamplingTensors

_ACCEPT_SALT = 0x5BD1E995  # the acceptance test's uniform: a stream apart from the draws'


@dataclass
class VerifiedTokens:
    """Per sequence: the tokens it emits (its accepted proposals, then one from the target) and
    their raw logprobs."""
    token_ids: list[list[int]]
    logprobs: list[list[float]]


def rejection_sample(logits: torch.Tensor, proposals: list[list[int]], rows: list[SamplingRow],
                     draft_probs: torch.Tensor | None = None) -> VerifiedTokens:
    """logits [sum(len(p) + 1), V]: each sequence's positions in order, sequences after each
    other. `rows[i]` is sequence i's sampling row at its first position (`output_index` = its
    output tokens so far). `draft_probs` [sum(len(p)), V]: the proposer's distribution at each
    proposed position (None: each proposal was a point mass)."""
    assert len(proposals) == len(rows)
    num_positions = sum(len(p) + 1 for p in proposals)
    assert logits.shape[0] == num_positions, (logits.shape, num_positions)
    device = logits.device
    vocab = logits.shape[1]
    pos_rows, proposed, has_proposal = [], [], []
    for row, props in zip(rows, proposals):
        for j in range(len(props) + 1):
            pos_rows.append(SamplingRow(row.params, row.seed, row.sample_index,
                                        row.output_index + j, [], []))
            has_proposal.append(j < len(props))
            proposed.append(props[j] if j < len(props) else 0)
    t = SamplingTensors.from_rows(pos_rows, vocab, device)
    logits = logits.float()
    log_norm = torch.logsumexp(logits, dim=-1)
    proposed_t = torch.tensor(proposed, dtype=torch.long, device=device)
    has_proposal_t = torch.tensor(has_proposal, dtype=torch.bool, device=device)
    pos = torch.arange(num_positions, device=device)

    argmax = logits.argmax(dim=-1)
    accepted = argmax == proposed_t  # the greedy rule
    drawn = argmax
    if not t.all_greedy:
        x = filter_scores(logits, t)  # [P, V]: the target's distribution at each position
        probs = x.softmax(dim=-1)
        p_of_proposal = probs[pos, proposed_t]
        if draft_probs is None:
            accept_prob = p_of_proposal
            # The residual of a point mass: p without the proposed token.
            residual = x.clone()
            residual[pos[has_proposal_t], proposed_t[has_proposal_t]] = float("-inf")
        else:
            index = torch.tensor([max(i, 0) for i in _proposed_positions(has_proposal)],
                                 dtype=torch.long, device=device)
            q = torch.zeros_like(probs)
            q[has_proposal_t] = draft_probs.float()[index[has_proposal_t]]
            q_of_proposal = q[pos, proposed_t].clamp(min=1e-30)
            accept_prob = (p_of_proposal / q_of_proposal).clamp(max=1.0)
            residual = (probs - q).clamp(min=0.0).log()
        # A residual with no mass left can only follow an acceptance of probability 1, which
        # is never rejected; fall back to p rather than draw from nothing.
        empty = torch.isinf(residual).all(dim=-1) & has_proposal_t
        residual[empty] = x[empty]
        residual[~has_proposal_t] = x[~has_proposal_t]  # the bonus position draws from p
        u = uniform_noise(mix32(noise_keys(t.seeds, t.sample_indices, t.output_indices)
                                 ^ _ACCEPT_SALT), 1)[:, 0]
        accepted = torch.where(t.is_greedy, accepted, u < accept_prob)
        drawn = torch.where(t.is_greedy, argmax, exponential_race(residual, t))
    accepted = accepted & has_proposal_t

    accepted_l, drawn_l = accepted.tolist(), drawn.tolist()
    lp_accepted = (logits[pos, proposed_t] - log_norm).tolist()
    lp_drawn = (logits[pos, drawn] - log_norm).tolist()
    out = VerifiedTokens([], [])
    start = 0
    for props in proposals:
        tokens, lps = [], []
        for j in range(len(props) + 1):
            i = start + j
            if j < len(props) and accepted_l[i]:
                tokens.append(props[j])
                lps.append(lp_accepted[i])
                continue
            tokens.append(drawn_l[i])
            lps.append(lp_drawn[i])
            break
        out.token_ids.append(tokens)
        out.logprobs.append(lps)
        start += len(props) + 1
    return out


def _proposed_positions(has_proposal: list[bool]) -> list[int]:
    """Position -> the index of its proposal among all proposals (-1 at bonus positions)."""
    out, n = [], 0
    for h in has_proposal:
        out.append(n if h else -1)
        n += h
    return out
