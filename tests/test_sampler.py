"""The batched sampler: each parameter, per-request seeds, logprobs, and whole-batch execution."""
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from services.worker.sampler import (Sampler, _top_k_top_p_by_sort, _top_k_top_p_in_candidates,
                                     apply_penalties, compute_prompt_logprobs, noise_keys,
                                     uniform_noise)
from services.worker.sampling_metadata import SamplingRow, SamplingTensors
from shared.sampling_params import SamplingParams

# A small known distribution for the statistical tests, most likely token first.
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
NUM_DRAWS = 4000
# Each draw uses its own seed, so the counts are fixed: a chi-square limit with p ~ 1e-4 at up to
# 7 degrees of freedom cannot flake, and an ignored parameter lands far above it (checked too).
CHI2_LIMIT = 30.0


def row(params: SamplingParams, seed: int = 0, sample_index: int = 0, output_index: int = 0,
        prompt: list[int] | None = None, output: list[int] | None = None) -> SamplingRow:
    return SamplingRow(params, seed, sample_index, output_index, prompt or [], output or [])


def sample(logits: torch.Tensor, rows: list[SamplingRow]):
    return Sampler()(logits, SamplingTensors.from_rows(rows, logits.shape[1], "cpu"))


def draw_counts(params: SamplingParams, probs: torch.Tensor = PROBS) -> torch.Tensor:
    """NUM_DRAWS independent draws from one distribution (one row per seed) -> counts [V]."""
    logits = probs.log().expand(NUM_DRAWS, -1).contiguous()
    tokens = sample(logits, [row(params, seed=i) for i in range(NUM_DRAWS)]).token_ids
    return torch.bincount(tokens, minlength=probs.shape[0]).float()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    expected = probs[support] / probs.sum() * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum())


def assert_follows(counts: torch.Tensor, expected: torch.Tensor, ignored: torch.Tensor):
    """Counts match `expected` (zero where it is zero) and not the distribution `ignored` that a
    sampler overlooking the parameter would give."""
    assert counts[expected == 0].sum() == 0, counts
    assert chi_square(counts, expected) < CHI2_LIMIT, (counts, expected)
    assert chi_square(counts, ignored) > 3 * CHI2_LIMIT, (counts, ignored)


def test_greedy_rows_pick_the_argmax():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    result = sample(logits, [row(SamplingParams(temperature=0.0), seed=i) for i in range(16)])
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))


def test_greedy_breaks_ties_toward_the_lowest_token_id_like_transformers():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    result = sample(logits, [row(SamplingParams(temperature=0.0))] * 2)
    assert result.token_ids.tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_fast_path_equals_the_torch_path(monkeypatch, dtype):
    """All-greedy batches without penalties or logprobs take the CPU kernel (argmax and its
    logprob read straight from the logits); everything it returns matches the general path:
    strided rows, ties, rows with -inf (min_tokens masking), bf16 logits."""
    from pagoda_kernels import cpu as cpu_kernels
    g = torch.Generator().manual_seed(3)
    wide = (torch.randn(8, 50_000, generator=g) * 4).to(dtype)
    logits = wide[:, 100:40_100]  # rows 50,000 apart: a strided view
    logits[1, 7] = logits[1, 12_345] = logits[1].max() + 1  # a tie: the first index wins
    logits[2, :30_000] = float("-inf")  # a masked stretch
    rows = [row(SamplingParams(temperature=0.0), seed=i) for i in range(8)]
    assert cpu_kernels.available_for(logits)
    fast = sample(logits, rows)
    monkeypatch.setattr(cpu_kernels, "available_for", lambda x: False)
    slow = sample(logits, rows)
    assert fast.token_ids.tolist()[1] == 7
    assert torch.equal(fast.token_ids, slow.token_ids)
    # Sums of ~40k exponentials in another order: float rounding apart, no more. The kernel
    # sums in float lanes, 16 with AVX-512 and 4 where the compiler takes 128-bit vectors (GCC
    # on a Zen 1), where its logprobs ran 5-9e-5 off.
    assert (fast.logprobs - slow.logprobs).abs().max() < 2e-4
    assert fast.top_token_ids is None and slow.top_token_ids is None


def test_temperature_one_samples_the_softmax():
    counts = draw_counts(SamplingParams(temperature=1.0))
    assert_follows(counts, PROBS, ignored=torch.full_like(PROBS, 1 / 6))


def test_temperature_sharpens_the_distribution():
    counts = draw_counts(SamplingParams(temperature=0.5))
    assert_follows(counts, PROBS ** 2 / (PROBS ** 2).sum(), ignored=PROBS)


def test_top_k_keeps_the_k_most_likely_tokens_renormalised():
    counts = draw_counts(SamplingParams(top_k=3))
    expected = torch.where(torch.arange(6) < 3, PROBS, 0.0)
    assert_follows(counts, expected / expected.sum(), ignored=PROBS)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Mass ranked above each token: 0, .4, .65, .8 -> p = 0.7 keeps the first three.
    counts = draw_counts(SamplingParams(top_p=0.7))
    expected = torch.where(torch.arange(6) < 3, PROBS, 0.0)
    assert_follows(counts, expected / expected.sum(), ignored=PROBS)


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    # 0.2 * 0.4 = 0.08: the tokens with 0.06 and 0.04 go.
    counts = draw_counts(SamplingParams(min_p=0.2))
    expected = torch.where(PROBS >= 0.08, PROBS, 0.0)
    assert_follows(counts, expected / expected.sum(), ignored=PROBS)


def test_top_k_top_p_on_candidates_matches_the_full_sort():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5000, generator=gen)
    x.scatter_add_(1, torch.randint(0, 5000, (4, 40), generator=gen), torch.full((4, 40), 8.0))
    top_k = torch.tensor([5000, 20, 5000, 100])  # 5000 = no limit
    top_p = torch.tensor([0.9, 0.8, float("inf"), float("inf")])
    by_candidates = _top_k_top_p_in_candidates(x.clone(), top_k, top_p)
    by_sort = _top_k_top_p_by_sort(x.clone(), top_k, top_p)
    assert by_candidates is not None
    assert torch.equal(by_candidates.isinf(), by_sort.isinf())
    assert torch.equal(by_candidates, by_sort)


def test_top_p_candidates_give_way_when_the_set_reaches_past_them():
    flat = torch.zeros(2, 5000)  # p = 0.9 of a uniform distribution needs 4500 tokens
    assert _top_k_top_p_in_candidates(flat, None, torch.tensor([0.9, 0.9])) is None


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.5]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    t = SamplingTensors.from_rows([row(params, prompt=[0, 1], output=[1, 3])], 5, "cpu")
    expected = torch.tensor([[1.0, -2.0, 0.5, -1.0, 1.5]])  # token 2 and 4 unseen
    assert torch.allclose(apply_penalties(logits, t.penalties), expected)
    assert Sampler()(logits, t).token_ids.tolist() == [4]  # unpenalised argmax would be 0


def test_repetition_penalty_matches_transformers():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 300, generator=gen)
    seen = torch.randint(0, 300, (3, 40), generator=gen)
    rows = [row(SamplingParams(temperature=0.0, repetition_penalty=1.3),
                prompt=seen[i, :25].tolist(), output=seen[i, 25:].tolist()) for i in range(3)]
    t = SamplingTensors.from_rows(rows, 300, "cpu")
    expected = RepetitionPenaltyLogitsProcessor(penalty=1.3)(seen, logits.clone())
    assert torch.allclose(apply_penalties(logits, t.penalties), expected)


def test_presence_and_frequency_penalties_subtract_per_output_occurrence():
    logits = torch.zeros(1, 5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    t = SamplingTensors.from_rows([row(params, prompt=[0, 4], output=[2, 2, 3])], 5, "cpu")
    # Prompt tokens are not penalised; token 2: -0.5 - 2 * 0.25, token 3: -0.5 - 0.25.
    expected = torch.tensor([[0.0, 0.0, -1.0, -0.75, 0.0]])
    assert torch.allclose(apply_penalties(logits, t.penalties), expected)


def test_a_batch_without_penalties_or_filters_builds_no_tensors_for_them():
    # Filters on a greedy row change nothing, so they do not count either.
    rows = [row(SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)),
            row(SamplingParams(temperature=0.7))]
    t = SamplingTensors.from_rows(rows, 100, "cpu")
    assert (t.penalties, t.top_k, t.top_p, t.min_p) == (None, None, None, None)
    assert (t.all_greedy, t.all_random, t.max_num_logprobs) == (False, False, 0)


def seeded_stream(seed: int, sample_index: int, steps: int, vocab: int = 1000,
                  mates: int = 0, position: int = 0) -> list[int]:
    """Tokens a seeded row draws from a flat distribution over `steps` steps, placed at
    `position` among `mates` other rows that have other logits, seeds and parameters."""
    gen = torch.Generator().manual_seed(seed + 7 * mates)
    mate_params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3),
                   SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.2)]
    tokens = []
    for step in range(steps):
        rows = [row(mate_params[i % 3], seed=1000 + i, output_index=step, output=[1, 2])
                for i in range(mates)]
        rows.insert(position, row(SamplingParams(), seed, sample_index, output_index=step))
        logits = torch.randn(mates + 1, vocab, generator=gen)
        logits[position] = 0.0
        tokens.append(int(sample(logits, rows).token_ids[position]))
    return tokens


def test_seeded_row_draws_the_same_tokens_whatever_its_batch_mates_and_position():
    alone = seeded_stream(1234, 0, steps=20)
    assert len(set(alone)) > 10  # the stream moves with output_index
    assert seeded_stream(1234, 0, steps=20, mates=5, position=3) == alone
    assert seeded_stream(1234, 0, steps=20, mates=8, position=8) == alone


def test_different_seeds_give_different_streams():
    a, b = seeded_stream(1, 0, steps=50), seeded_stream(2, 0, steps=50)
    assert sum(x == y for x, y in zip(a, b)) < 5


def test_different_sample_indices_give_different_streams():
    a, b = seeded_stream(1, 0, steps=50), seeded_stream(1, 1, steps=50)
    assert sum(x == y for x, y in zip(a, b)) < 5


def test_noise_keys_fit_in_32_bits_for_any_seed():
    seeds = [0, 1, 2 ** 32, 2 ** 32 + 1, 2 ** 64 + 5, -1, 2 ** 63 - 1]
    t = SamplingTensors.from_rows([row(SamplingParams(), seed=s) for s in seeds], 10, "cpu")
    keys = noise_keys(t.seeds, t.sample_indices, t.output_indices)
    assert keys.min() >= 0 and keys.max() < 2 ** 32
    # High bits count; seeds fold to 63 bits, so -1 and 2**63 - 1 are one seed.
    assert len(set(keys.tolist())) == len(seeds) - 1


def noise_rows(num_rows: int, vocab: int) -> torch.Tensor:
    """[num_rows, vocab] noise of rows with consecutive seeds."""
    seeds = torch.arange(num_rows)
    return uniform_noise(noise_keys(seeds, torch.zeros_like(seeds), torch.zeros_like(seeds)), vocab)


def test_uniform_noise_has_mean_one_half_and_variance_one_twelfth():
    u = noise_rows(64, 4096).double()  # 262144 values: standard errors ~6e-4 and ~1.5e-4
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.003
    assert abs(u.var() - 1 / 12) < 0.001


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]).double())[0, 1])


def test_uniform_noise_is_uncorrelated_between_adjacent_vocab_ids():
    u = noise_rows(64, 4096)
    assert abs(correlation(u[:, :-1], u[:, 1:])) < 0.01  # 5 standard errors


def test_uniform_noise_is_uncorrelated_between_adjacent_seeds():
    u = noise_rows(64, 4096)
    assert abs(correlation(u[:-1], u[1:])) < 0.01


def test_logprobs_are_the_raw_log_softmax_whatever_the_parameters():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    rows = [row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.3, top_k=5), seed=1),
            row(SamplingParams(temperature=1.5, repetition_penalty=1.5), output=[3, 4]),
            row(SamplingParams(min_p=0.2, top_p=0.5, presence_penalty=1.0), output=[7])]
    result = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(result.logprobs, raw.gather(1, result.token_ids[:, None]).squeeze(1),
                          atol=1e-5)


def test_top_logprobs_are_the_sorted_top_k_of_the_raw_distribution():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    rows = [row(SamplingParams(logprobs=2)), row(SamplingParams(temperature=0.0, logprobs=5)),
            row(SamplingParams(temperature=0.5, top_k=1))]
    result = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert result.top_logprobs.shape == (3, 5)  # K is the largest request in the batch
    expected_lps, expected_ids = raw.topk(5, dim=-1)
    assert torch.equal(result.top_token_ids, expected_ids)
    assert torch.allclose(result.top_logprobs, expected_lps, atol=1e-5)
    assert (result.top_logprobs[:, :-1] >= result.top_logprobs[:, 1:]).all()


def test_top_logprobs_are_none_when_no_row_asks():
    result = sample(torch.randn(2, 10), [row(SamplingParams()), row(SamplingParams(logprobs=0))])
    assert result.top_token_ids is None and result.top_logprobs is None


def test_prompt_logprobs_are_the_log_softmax_of_each_target():
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(5))
    targets = torch.tensor([3, 0, 39, 5, 5, 12, 1])
    token_lps, top_ids, top_lps = compute_prompt_logprobs(logits, targets, num_top=3)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(token_lps, raw[torch.arange(7), targets], atol=1e-5)
    expected_lps, expected_ids = raw.topk(3, dim=-1)
    assert torch.equal(top_ids, expected_ids)
    assert torch.allclose(top_lps, expected_lps, atol=1e-5)


def test_a_mixed_batch_samples_each_row_by_its_own_parameters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(4, 1)
    seeded = row(SamplingParams(temperature=2.0), seed=99, output_index=4)
    rows = [row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.0, repetition_penalty=10.0), prompt=[0]),
            row(SamplingParams(temperature=5.0, top_k=1), seed=3),
            seeded]
    tokens = sample(logits, rows).token_ids.tolist()
    assert tokens[:3] == [0, 1, 0]  # argmax; argmax once token 0 is penalised; top-1
    assert tokens[3] == sample(logits[:1], [seeded]).token_ids.item()


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def timed(sampler: Sampler, logits: torch.Tensor, t: SamplingTensors) -> float:
    start = time.perf_counter()
    sampler(logits, t)
    return time.perf_counter() - start


@pytest.mark.parametrize("kind", ["greedy", "random", "mixed"])
def test_sampler_runs_the_same_ops_for_any_batch_size(kind):
    vocab = 49152
    params = {"greedy": [SamplingParams(temperature=0.0)],
              "random": [SamplingParams(temperature=0.8)],
              "mixed": [SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=3),
                        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05,
                                       presence_penalty=0.5)]}[kind]
    gen = torch.Generator().manual_seed(6)
    ops, seconds = {}, {}
    for num_rows in (2, 64):
        logits = torch.randn(num_rows, vocab, generator=gen)
        logits[:, :30] += 10.0  # an LM-like peak, so top-p stays within the candidates
        rows = [row(params[i % len(params)], seed=i, output_index=3, prompt=[5, 6], output=[7])
                for i in range(num_rows)]
        t = SamplingTensors.from_rows(rows, vocab, "cpu")
        with OpRecorder() as recorder:
            Sampler()(logits, t)
        ops[num_rows] = recorder.ops
        seconds[num_rows] = min(timed(Sampler(), logits, t) for _ in range(3))
    print(f"\n{kind} sampler on 64 x {vocab}: {seconds[64] * 1e3:.1f} ms "
          f"(2 rows: {seconds[2] * 1e3:.1f} ms)")
    assert ops[64] == ops[2]
