"""Per-sequence grammar matchers and the token bitmask of a step's constrained rows.

A sequence's matcher lives beside its tokens in the worker, which holds every token (including
the ones it sampled itself before the engine read them), so constrained rows keep the engine's
one-step overlap. A matcher is never sent anywhere: when it is missing (first sight, a `reset`
after preemption, a forked child, a new worker process) it is rebuilt from the sequence's output
tokens, which gives the state the live matcher would have reached.
"""
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from shared.logging import get_logger

log = get_logger("worker.grammar")


@dataclass
class SequenceMatcher:
    """One sequence's place in its grammar."""
    matcher: object | None  # xgrammar.GrammarMatcher; None when the grammar failed to compile
    num_fed: int = 0  # output tokens given to the matcher so far (a rejected one counts too)

    @property
    def terminated(self) -> bool:
        """Nothing but a stop token may follow (the grammar ended, or never compiled)."""
        return self.matcher is None or self.matcher.is_terminated()


def new_matcher(grammar: Future, stop_token_ids: list[int]) -> SequenceMatcher:
    """A matcher at the grammar's start; waits for the grammar if it is still compiling."""
    import xgrammar
    try:
        compiled = grammar.result()
    except Exception:  # logged where it was compiled; the request may then only stop
        return SequenceMatcher(None)
    return SequenceMatcher(xgrammar.GrammarMatcher(
        compiled, override_stop_tokens=stop_token_ids or None))


def feed(m: SequenceMatcher, output_token_ids: list[int]) -> None:
    """Advance `m` over the output tokens it has not seen yet (all of them for a new matcher)."""
    for token in output_token_ids[m.num_fed:]:
        if not m.terminated and not m.matcher.accept_token(token):
            log.warning("a token outside the grammar was sampled", token_id=token)
    m.num_fed = len(output_token_ids)


class GrammarMasker:
    """Fills one step's token bitmask for the constrained rows in one batched call and applies it
    to the logits in place; then advances the matchers with the sampled tokens."""

    def __init__(self, vocab_size: int, device: torch.device):
        import xgrammar
        self.xgr = xgrammar
        self.batch = xgrammar.BatchGrammarMatcher()
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = (vocab_size + 31) // 32
        self.bitmask = torch.empty(0, self.num_words, dtype=torch.int32)
        # On CUDA: recorded after the last copy out of the page-locked bitmask, which the next
        # step (launched before this one has run) must not refill before the copy has left.
        self._copied = None

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if self.bitmask.shape[0] < num_rows:
            self.bitmask = torch.empty(max(num_rows, 2 * self.bitmask.shape[0]), self.num_words,
                                       dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        return self.bitmask[:num_rows]

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[SequenceMatcher],
             stop_token_ids: list[list[int]]) -> None:
        """Mask logits[rows[i]] to what matchers[i] allows (-inf elsewhere). One matcher may be
        listed for several rows (the n samples of a prompt step): each gets its mask."""
        if self._copied is not None:
            self._copied.synchronize()
        bitmask = self._buffer(logits.shape[0])
        live, live_rows, copies, first_row = [], [], [], {}
        for row, m, stops in zip(rows, matchers, stop_token_ids):
            if id(m) in first_row:
                copies.append((first_row[id(m)], row))
                continue
            first_row[id(m)] = row
            if m.terminated:
                # Only the request's stop tokens may follow.
                words = bitmask[row].numpy().view(np.uint32)
                words[:] = 0
                for token in stops:
                    words[token >> 5] |= np.uint32(1 << (token & 31))
            else:
                live.append(m.matcher)
                live_rows.append(row)
        if live:
            self.batch.batch_fill_next_token_bitmask(live, bitmask, indices=live_rows)
        for src, dst in copies:
            bitmask[dst] = bitmask[src]
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                             indices=rows)

    def advance(self, matchers: list[SequenceMatcher], token_ids: list[int]) -> None:
        """Feed each matcher the token just sampled for it (a matcher listed twice only takes
        its first token: the others belong to children the engine forks from it)."""
        live, tokens, seen = [], [], set()
        for m, token in zip(matchers, token_ids):
            if id(m) in seen:
                continue
            seen.add(id(m))
            m.num_fed += 1
            if not m.terminated:
                live.append(m.matcher)
                tokens.append(token)
        if live:
            accepted = self.batch.batch_accept_token(live, tokens)
            if not all(accepted):
                log.warning("tokens outside the grammar were sampled",
                            token_ids=[t for t, ok in zip(tokens, accepted) if not ok])
