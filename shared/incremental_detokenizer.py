"""Incremental detokenization and stop strings, per sequence.

Text is decoded over a short sliding window of token ids, so each new token costs a constant
amount of work, and a delta is held back while it ends in an incomplete UTF-8 character.
"""

# Prompt tokens decoded before the first output token, so the first word gets its leading space.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0  # start of the window decoded as context
        self.read_offset = len(self.token_ids)  # tokens before this are already emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)

    def decode_incremental(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # an incomplete character, or a token that decodes to nothing yet
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def find_stop_string(text: str, new_len: int, stop: list[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """Look for a stop string that ends within the last `new_len` characters of `text`.

    Returns (the stop string, the length `text` is cut to), or None.
    """
    if not stop or new_len == 0:
        return None
    best = None
    for s in stop:
        i = text.find(s, max(0, len(text) - new_len - len(s) + 1))
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, (i + len(s) if include_stop_str_in_output else i)
