"""N-gram (prompt lookup) proposals: the tokens that followed an earlier occurrence of the
sequence's last n tokens (the latest with k tokens after it), n from `prompt_lookup_max` down
to `prompt_lookup_min`.

It costs no model: text that repeats its context (code edits, summaries quoting their source,
structured data) gets several tokens per step; elsewhere it proposes nothing and the step is an
ordinary decode.
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) tokens to follow `token_ids`; [] when no n-gram recurs."""
        k = min(self.k, max_tokens)
        length = len(token_ids)
        if k <= 0 or length < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = tokens[length - n:]
            # Windows that end before the last token, so at least one token follows each.
            windows = sliding_window_view(tokens[:length - 1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if starts.size:
                # The latest match with k tokens after it, else the earliest (the most after).
                full = starts[starts + n + k <= length]
                follow = int(full[-1] if full.size else starts[0]) + n
                return tokens[follow:follow + k].tolist()
        return []
