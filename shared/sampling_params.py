"""SamplingParams: how to sample one request, with vLLM's names and checks."""
import math
from dataclasses import dataclass, field

from shared.structured_output import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `field` names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives returned per generated token
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # The grammar the output must follow (None: free text).
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias; values are
    # clamped to [-100, 100]). Token ids are checked against the vocabulary by the engine.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's field).
    allowed_token_ids: list[int] | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown field
                raise SamplingParamsError("structured_outputs", str(e)) from None
        if isinstance(self.top_k, int) and self.top_k == -1:
            self.top_k = 0
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.verify()
        if self.logit_bias is not None:
            self.logit_bias = {t: float(min(100.0, max(-100.0, b)))
                               for t, b in self.logit_bias.items()}

    def verify(self) -> None:
        """Raise SamplingParamsError naming the first bad field (run at creation; run it again
        after changing a field)."""
        def fail(name, msg):
            raise SamplingParamsError(name, msg)

        def number(name, lo=None, hi=None, lo_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                fail(name, f"must be a finite number, got {v!r}")
            if lo is not None and (v < lo or (lo_open and v == lo)):
                fail(name, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
            if hi is not None and v > hi:
                fail(name, f"must be <= {hi}, got {v}")

        def integer(name, lo=None):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                fail(name, f"must be an integer, got {v!r}")
            if lo is not None and v < lo:
                fail(name, f"must be >= {lo}, got {v}")

        integer("n", 1)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, lo_open=True)
        number("temperature", 0.0)
        number("top_p", 0.0, 1.0, lo_open=True)
        integer("top_k", 0)
        number("min_p", 0.0, 1.0)
        if self.seed is not None:
            integer("seed")
        if self.max_tokens is not None:
            integer("max_tokens", 1)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                integer(name, 0)
                if getattr(self, name) > 20:
                    fail(name, f"must be <= 20, got {getattr(self, name)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids):
            fail("stop_token_ids", f"must be a list of non-negative integers, "
                                   f"got {self.stop_token_ids!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                fail("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.verify()
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    fail("logit_bias", f"keys must be non-negative token ids, got {token!r}")
                if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                        or not math.isfinite(bias)):
                    fail("logit_bias", f"token {token}: the bias must be a finite number, "
                                       f"got {bias!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in self.allowed_token_ids)):
            fail("allowed_token_ids", f"must be a non-empty list of non-negative token ids, "
                                      f"got {self.allowed_token_ids!r}")
        if self.n > 1 and self.is_greedy:
            # n greedy samples would be n copies of one completion.
            fail("n", "n > 1 needs temperature > 0 (greedy sampling gives identical completions)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def verify_token_ids(self, vocab_size: int) -> None:
        """Raise SamplingParamsError if logit_bias or allowed_token_ids names an id outside
        [0, vocab_size) (the engine knows the vocabulary; `verify` does not)."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingParamsError(name, f"token id {bad[0]} is out of the vocabulary "
                                                f"[0, {vocab_size})")

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
