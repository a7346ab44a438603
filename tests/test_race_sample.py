"""The sampler's random draws in C (pagoda_kernels/cpu/race_sample.c) against the torch ops they
replace: the exponential race token for token, over fresh random logits of many shapes and
scales (scale 0: the noise alone decides), with filtered (-inf) entries, ties and strided rows,
float32 and bf16; the temperature-only path with greedy rows mixed in, and its logprobs; and
the Sampler taking each path where it should, with the same draws as without the kernels."""
import pytest
import torch

from pagoda_kernels import cpu as cpu_kernels
from services.worker import sampler as sampler_module
from services.worker.sampler import Sampler, exponential_race_torch, noise_keys
from services.worker.sampling_metadata import SamplingTensors
from shared.sampling_params import SamplingParams
from tests.test_sampler import row

pytestmark = pytest.mark.skipif(
    not cpu_kernels.race_sample_available(torch.empty(1, 1)),
    reason="the sampler's C random draws need a CPU with AVX-512 or AVX2 and FMA (and the C "
           "kernels built)")


def keys_for(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2 ** 62, (rows,), generator=g)
    return noise_keys(seeds, torch.randint(0, 4, (rows,), generator=g),
                      torch.randint(0, 10_000, (rows,), generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (5, 16), (2, 17), (7, 1000),
                                        (64, 49_157)])
@pytest.mark.parametrize("scale", [0.0, 1.0, 5.0])
def test_race_sample_draws_the_torch_races_tokens(dtype, rows, vocab, scale):
    g = torch.Generator().manual_seed(rows * 7919 + vocab)
    x = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
    if vocab > 2:
        x[:, 1::3] = float("-inf")  # filtered out: never drawn
    keys = keys_for(rows, vocab)
    expected = exponential_race_torch(x.float(), keys)
    got = cpu_kernels.race_sample(x, keys)
    assert got.tolist() == expected.tolist()
    if vocab > 2:
        assert (got % 3 != 1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race_sample_reads_strided_rows(dtype):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 3000, generator=g).to(dtype)
    x = wide[:, 500:2500]
    keys = keys_for(6, 1)
    assert (cpu_kernels.race_sample(x, keys).tolist()
            == exponential_race_torch(x.float(), keys).tolist())


def test_race_sample_ties_and_rows_with_nothing_to_draw_go_as_torch_argmax():
    """+inf twice in a row (the first wins, whichever lanes hold them), a row all -inf (token
    0), a row whose one finite value sits in the last, partial vector."""
    x = torch.full((3, 40), float("-inf"))
    x[0, 5] = x[0, 37] = x[0, 21] = float("inf")
    x[2, 38] = 1.0
    keys = keys_for(3, 4)
    assert cpu_kernels.race_sample(x, keys).tolist() == [5, 0, 38]
    assert exponential_race_torch(x, keys).tolist() == [5, 0, 38]


def test_race_sample_refuses_keys_that_are_not_one_per_row():
    with pytest.raises(ValueError, match="one per row"):
        cpu_kernels.race_sample(torch.zeros(4, 10), keys_for(3, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_sample_draws_at_each_rows_temperature_and_argmaxes_greedy_rows(dtype):
    g = torch.Generator().manual_seed(2)
    rows, vocab = 40, 32_003
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    is_greedy = torch.arange(rows) % 4 == 0
    temperature[is_greedy] = 1.0  # as SamplingTensors holds greedy rows
    keys = keys_for(rows, 2)
    tokens, logprobs = cpu_kernels.random_sample(logits, temperature, is_greedy, keys)
    x = logits.float()
    drawn = exponential_race_torch(x / temperature[:, None], keys)
    expected = torch.where(is_greedy, x.argmax(dim=-1), drawn)
    assert tokens.tolist() == expected.tolist()
    raw = torch.log_softmax(x, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert (logprobs - raw).abs().max() < 5e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_draws_the_same_with_and_without_the_kernels(monkeypatch, dtype):
    """A temperature-only batch with greedy rows mixed in (the one-call path), one with top-k /
    top-p and one asking for logprobs (torch ops, then the C race) against the torch ops alone;
    each takes the path it should."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 5000, generator=g) * 2).to(dtype)
    batches = {
        "random_sample": [row(SamplingParams(temperature=0.0 if i % 3 == 0 else 0.7 + 0.1 * i),
                              seed=i) for i in range(12)],
        "race_sample": [row(SamplingParams(temperature=1.0, top_k=50, top_p=0.9), seed=i)
                        for i in range(12)],
        "logprobs": [row(SamplingParams(temperature=0.9, logprobs=2), seed=i) for i in range(12)],
    }
    for path, rows in batches.items():
        tensors = SamplingTensors.from_rows(rows, logits.shape[1], "cpu")
        calls = []
        with monkeypatch.context() as m:
            for name in ("random_sample", "race_sample"):
                kernel = getattr(sampler_module.cpu_kernels, name)
                m.setattr(sampler_module.cpu_kernels, name,
                          lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
            with_kernels = Sampler()(logits, tensors)
        assert calls == (["race_sample"] if path == "logprobs" else [path])
        with monkeypatch.context() as m:
            m.setattr(sampler_module.cpu_kernels, "race_sample_available", lambda x: False)
            without = Sampler()(logits, tensors)
        assert with_kernels.token_ids.tolist() == without.token_ids.tolist()
        assert (with_kernels.logprobs - without.logprobs).abs().max() < 5e-5
