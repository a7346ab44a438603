"""The batched sampler: one step's logits [N, vocab] -> one token per row, with logprobs.

Order of work, as in vLLM v1: penalties on the raw logits -> greedy argmax, or temperature ->
min-p -> top-k -> top-p -> a random draw. Logprobs are always of the raw distribution
(log_softmax of the logits the model produced), whatever the parameters did to the draw.

Random numbers do not come from a shared generator: each row's noise is a counter-based hash of
(seed, sample_index, output_index, vocab id), so a seeded request draws the same tokens whatever
else is in the batch and whichever row it lands in.
"""
import importlib.util
from dataclasses import dataclass

import torch

from pagoda_kernels import cpu as cpu_kernels
from services.worker.sampling_metadata import PenaltyTensors, SamplingTensors

_MASK32 = 0xFFFFFFFF
_ONE_BELOW_1 = 1.0 - 2.0 ** -24  # the largest float32 below 1
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplerResult:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32, raw logprob of the sampled token
    top_token_ids: torch.Tensor | None  # [N, K] int64, K = max requested logprobs (None if 0)
    top_logprobs: torch.Tensor | None  # [N, K] float32, sorted descending


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerResult:
        assert logits.shape == (t.num_rows, t.vocab_size), (logits.shape, t.num_rows, t.vocab_size)
        # No penalties and no top logprobs: the CPU kernels draw straight from the logits (no
        # float copy) and return the drawn token's logprob with it.
        plain = t.penalties is None and t.max_num_logprobs == 0
        if plain and t.all_greedy and cpu_kernels.available_for(logits):
            # argmax and its logprob in two passes per row
            token_ids, token_logprobs = cpu_kernels.greedy_sample(logits)
            return SamplerResult(token_ids, token_logprobs, None, None)
        if (plain and t.min_p is None and t.top_k is None and t.top_p is None
                and cpu_kernels.race_sample_available(logits)):
            # Temperature only (what most clients send): the noise made on the fly, the same
            # draws as below.
            token_ids, token_logprobs = cpu_kernels.random_sample(
                logits, t.temperature, t.is_greedy, _keys(t))
            return SamplerResult(token_ids, token_logprobs, None, None)
        logits = logits.float()  # [N, V]
        # 1) Normaliser of the raw distribution: logprob = logit - logsumexp, so no [N, V]
        #    log_softmax is kept.
        log_norm = torch.logsumexp(logits, dim=-1)  # [N]

        # 2) Penalties change what is drawn (greedy rows included), never the logprobs.
        scores = apply_penalties(logits, t.penalties) if t.penalties is not None else logits

        # 3) Draw.
        if t.all_greedy:
            token_ids = scores.argmax(dim=-1)
        else:
            sampled = _sample_random(scores, t)
            token_ids = sampled if t.all_random else torch.where(
                t.is_greedy, scores.argmax(dim=-1), sampled)

        # 4) Logprobs.
        token_logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - log_norm
        top_ids = top_lps = None
        if t.max_num_logprobs > 0:
            top_values, top_ids = logits.topk(t.max_num_logprobs, dim=-1)  # sorted
            top_lps = top_values - log_norm[:, None]
        return SamplerResult(token_ids, token_logprobs, top_ids, top_lps)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_top: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [P, V] where row i predicts target_token_ids[i] ([P] int64) ->
    (logprob of each target [P], top ids [P, num_top] int64, their logprobs [P, num_top])."""
    logits = logits.float()
    log_norm = torch.logsumexp(logits, dim=-1)  # [P]
    token_logprobs = logits.gather(1, target_token_ids[:, None].long()).squeeze(1) - log_norm
    top_values, top_ids = logits.topk(num_top, dim=-1)
    return token_logprobs, top_ids, top_values - log_norm[:, None]


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (transformers: divide positive logits,
    multiply negative ones), then presence and frequency penalties over output tokens (OpenAI)."""
    in_output = p.output_counts > 0  # [N, V]
    seen = p.prompt_mask | in_output
    repetition = p.repetition[:, None]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    scores = torch.where(seen, penalised, logits)
    scores -= p.frequency[:, None] * p.output_counts
    scores -= p.presence[:, None] * in_output
    return scores


def _sample_random(scores: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Filtered, temperature-scaled draw for every row -> [N] int64 (greedy rows get a value
    the caller discards)."""
    return exponential_race(filter_scores(scores, t), t)


def filter_scores(scores: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p: the logits ([N, V], new) of the distribution a row
    draws from, filtered tokens at -inf (softmax of them is that distribution)."""
    x = scores / t.temperature[:, None]  # [N, V], a fresh tensor the filters may edit in place
    if t.min_p is not None:
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf cuts nothing.
        threshold = x.amax(dim=-1, keepdim=True) + t.min_p.log()[:, None]
        x.masked_fill_(x < threshold, float("-inf"))
    if (t.top_p is not None or t.top_k is not None) and _filters_in_triton(x):
        x = _triton_top_k_top_p(x, t.top_k, t.top_p)
    elif t.top_p is not None:
        x = _apply_top_k_top_p(x, t.top_k, t.max_top_k, t.top_p)
    elif t.top_k is not None:
        x = _apply_top_k(x, t.top_k, t.max_top_k)
    return x


def exponential_race(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """A draw from softmax(x) per row ([N, V] logits, -inf = excluded) -> [N] int64, with each
    row's counter-based noise (seed, sample index, output index)."""
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i; in the
    # log domain the softmax normaliser drops out: argmax x_i - log E_i.
    keys = _keys(t)
    if cpu_kernels.race_sample_available(x):
        return cpu_kernels.race_sample(x, keys)  # the same race, no [N, V] temporaries
    return exponential_race_torch(x, keys)


def exponential_race_torch(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`exponential_race` in torch ops, from the rows' noise keys ([N], `noise_keys`)."""
    u = uniform_noise(keys, x.shape[1])  # [N, V] in (0, 1)
    exp_noise = u.neg_().log1p_().neg_()  # -log(1 - u): precise for the small E that win
    return (x - exp_noise.log_()).argmax(dim=-1)


def _keys(t: SamplingTensors) -> torch.Tensor:
    return noise_keys(t.seeds, t.sample_indices, t.output_indices)


def _filters_in_triton(x: torch.Tensor) -> bool:
    """Top-k / top-p on CUDA run as one Triton kernel (a threshold search per row, no sort of
    the vocabulary); the CPU keeps its candidate path."""
    return x.is_cuda and importlib.util.find_spec("triton") is not None


def _triton_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor | None) -> torch.Tensor:
    from pagoda_kernels.triton.top_k_top_p import top_k_top_p  # triton only where it is chosen
    return top_k_top_p(x, top_k, top_p, out=x)


def _apply_top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    # Keep logits >= each row's k-th largest (ties at the edge are kept, as in transformers).
    vocab_size = x.shape[1]
    top_values = x.topk(max_top_k, dim=-1).values  # [N, max_top_k], descending
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])  # [N, 1]
    kth = kth.masked_fill(top_k[:, None] >= vocab_size, float("-inf"))  # rows without a limit
    return x.masked_fill_(x < kth, float("-inf"))


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                       top_p: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and max_top_k <= _TOP_P_CANDIDATES < x.shape[1]:
        # On the CPU a sort of the whole vocabulary costs more than the rest of the sampler, and
        # the top-p set nearly always lies within the largest logits: try those first.
        filtered = _top_k_top_p_in_candidates(x, top_k, top_p)
        if filtered is not None:
            return filtered
    return _top_k_top_p_by_sort(x, top_k, top_p)


def _top_k_top_p_by_sort(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
                         ) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
    if top_k is not None:
        kth = sorted_x.gather(1, (top_k - 1)[:, None])  # k = V on rows without a limit
        sorted_x.masked_fill_(sorted_x < kth, float("-inf"))
    _cut_top_p(sorted_x, sorted_x.softmax(dim=-1), top_p)
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _top_k_top_p_in_candidates(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
                               ) -> torch.Tensor | None:
    """Top-k and top-p within each row's largest logits; None when some row's top-p set could
    reach past them. Needs every top-k limit within the candidates."""
    vocab_size = x.shape[1]
    cand_x, cand_ids = x.topk(_TOP_P_CANDIDATES, dim=-1)  # [N, C], descending
    log_norm = torch.logsumexp(x, dim=-1)  # [N], of the distribution top-p sees
    limited = top_p <= 1.0  # [N]
    if top_k is not None:
        limited_k = top_k < vocab_size
        kth = cand_x.gather(1, (top_k.clamp(max=_TOP_P_CANDIDATES) - 1)[:, None])
        cand_x.masked_fill_(cand_x < kth, float("-inf"))
        log_norm = torch.where(limited_k, torch.logsumexp(cand_x, dim=-1), log_norm)
        limited = limited | limited_k
    probs = (cand_x - log_norm[:, None]).exp()  # [N, C]
    if not ((probs.sum(dim=-1) >= top_p) | (top_p > 1.0)).all():  # a host sync, free on the CPU
        return None
    _cut_top_p(cand_x, probs, top_p)
    # Rows with a limit keep only (some of) their candidates; the others keep every logit.
    return x.masked_fill(limited[:, None], float("-inf")).scatter_(1, cand_ids, cand_x)


def _cut_top_p(sorted_x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place on descending logits: keep the smallest top set whose mass reaches p, i.e. a
    token stays while the mass ranked strictly above it is below p (the first always stays)."""
    mass_above = probs.cumsum(dim=-1) - probs
    sorted_x.masked_fill_(mass_above >= top_p[:, None], float("-inf"))


# Counter-based noise. Values are 32-bit numbers held in int64; the multipliers are below 2**31,
# so no product reaches 2**63 and nothing overflows on any device.

def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit xorshift-multiply hash, in place on x (int64 holding 32-bit values)."""
    x.bitwise_xor_(x >> 15)
    x.mul_(0x2C1B3C6D).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 12)
    x.mul_(0x297A2D39).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


def noise_keys(seeds: torch.Tensor, sample_indices: torch.Tensor, output_indices: torch.Tensor
               ) -> torch.Tensor:
    """[N] int64 seeds (< 2**63), sample and output indices -> [N] 32-bit keys, one per draw."""
    key = mix32((seeds & _MASK32) ^ 0x9E3779B9)
    key = mix32(key ^ (seeds >> 32))
    key = mix32(key ^ (sample_indices & _MASK32))
    return mix32(key ^ (output_indices & _MASK32))


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N] keys -> [N, vocab_size] float32 uniform in (0, 1), a pure function of (key, vocab id)."""
    vocab_hash = mix32(torch.arange(vocab_size, device=keys.device) ^ 0x85EBCA6B)  # [V]
    bits = mix32(keys[:, None] ^ vocab_hash[None, :])  # [N, V]
    # Small values stay exact in float32; rounding near 1 is clamped so 1 itself never appears.
    return bits.float().add_(0.5).mul_(2.0 ** -32).clamp_(max=_ONE_BELOW_1)
