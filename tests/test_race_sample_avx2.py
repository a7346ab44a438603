"""The sampler's random draws and greedy statistics on AVX2 (race_sample.c's AVX2 loop,
sampling_row.h's) on any CPU with AVX2 and FMA: the kernels built a second time without AVX-512
(`build.load_variant`), so a CPU with AVX-512, whose default build runs the AVX-512 loop, checks
it too. (Without AVX-512, tests/test_race_sample.py runs this loop as well.) The draws must be
the torch race's, token for token: the loop rebuilds the conversions AVX2 lacks from integer
ops, and an error there beyond the last bit would move draws (one in the last bit would show
only at a near-tie of two keys)."""
import pytest
import torch

from pagoda_kernels.cpu import bind, build
from services.worker.sampler import exponential_race_torch
from tests.test_f32_panels_avx2 import NEEDS_AVX2_FMA
from tests.test_race_sample import keys_for

pytestmark = NEEDS_AVX2_FMA


@pytest.fixture(scope="module")
def avx2():
    lib = build.load_variant(["-mno-avx512f"])
    for name in ("race_sample", "random_sample", "greedy_sample"):
        for suffix in ("f32", "bf16"):
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = bind._SIGNATURES[name]
    return lib


def _race(lib, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    rows, vocab = x.shape
    keys = keys.to(torch.int32).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    fn = lib.race_sample_f32 if x.dtype == torch.float32 else lib.race_sample_bf16
    assert fn(x.data_ptr(), x.stride(0), rows, vocab, keys.data_ptr(), tokens.data_ptr()) == 0
    return tokens


def test_the_build_without_avx512_has_the_race(avx2):
    assert avx2.race_sample_available() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (5, 8), (2, 9), (7, 1000), (64, 49_157)])
@pytest.mark.parametrize("scale", [0.0, 1.0, 5.0])
def test_avx2_race_draws_the_torch_races_tokens(avx2, dtype, rows, vocab, scale):
    """Scale 0: the noise alone decides, so every bit of the noise's logarithms counts; vocab
    sizes end mid-vector (the padded last vector) or on a vector's edge."""
    g = torch.Generator().manual_seed(rows * 7919 + vocab)
    x = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
    if vocab > 2:
        x[:, 1::3] = float("-inf")  # filtered out: never drawn
    keys = keys_for(rows, vocab)
    got = _race(avx2, x, keys)
    assert got.tolist() == exponential_race_torch(x.float(), keys).tolist()
    if vocab > 2:
        assert (got % 3 != 1).all()


def test_avx2_race_ties_and_rows_with_nothing_to_draw(avx2):
    """+inf three times in a row, in different lanes (the first wins), a row all -inf (token
    0), a row whose one finite value is in the padded last vector."""
    x = torch.full((3, 21), float("-inf"))
    x[0, 5] = x[0, 19] = x[0, 10] = float("inf")
    x[2, 20] = 1.0
    assert _race(avx2, x, keys_for(3, 3)).tolist() == [5, 0, 20]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_random_sample_mixes_greedy_rows_and_draws(avx2, dtype):
    """The temperature-only path: greedy rows take the first argmax, the others the race over
    logits / temperature, and every row's logprob is under the raw logits."""
    g = torch.Generator().manual_seed(5)
    rows, vocab = 6, 3001
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.5])
    greedy = torch.tensor([1, 0, 0, 1, 0, 0], dtype=torch.uint8)
    keys = keys_for(rows, 9)
    keys32 = keys.to(torch.int32)  # the low 32 bits, as the C side reads them
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows)
    fn = avx2.random_sample_f32 if dtype == torch.float32 else avx2.random_sample_bf16
    assert fn(logits.data_ptr(), logits.stride(0), rows, vocab, temperature.data_ptr(),
              greedy.data_ptr(), keys32.data_ptr(), tokens.data_ptr(), logprobs.data_ptr()) == 0
    x = logits.float()
    drawn = exponential_race_torch(x / temperature[:, None], keys)
    expected = torch.where(greedy.bool(), x.argmax(dim=1), drawn)
    assert tokens.tolist() == expected.tolist()
    raw = torch.log_softmax(x, dim=1).gather(1, expected[:, None])[:, 0]
    assert (logprobs - raw).abs().max() < 5e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 49_157])
def test_avx2_greedy_takes_the_first_argmax_and_its_logprob(avx2, dtype, vocab):
    """Rows: random; a tie of the max in two vectors (the first wins); a NaN beside the max
    (skipped); the max alone in the last, partial vector; all -inf (token 0, as torch)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(5, vocab, generator=g) * 4).to(dtype)
    if vocab > 8:
        x[1, 3] = x[1, vocab - 1] = 50.0
        x[2, 0] = float("nan")
        x[2, 5] = 60.0
        x[3, vocab - 1] = 70.0
    x[4] = float("-inf")
    tokens = torch.empty(5, dtype=torch.int64)
    logprobs = torch.empty(5)
    fn = avx2.greedy_sample_f32 if dtype == torch.float32 else avx2.greedy_sample_bf16
    fn(x.data_ptr(), x.stride(0), 5, vocab, tokens.data_ptr(), logprobs.data_ptr())
    clean = x.float().nan_to_num(nan=float("-inf"))
    assert tokens.tolist() == clean.argmax(dim=1).tolist()
    expected = torch.log_softmax(clean[:4], dim=1).gather(1, tokens[:4, None])[:, 0]
    finite = [0, 1, 3] if vocab > 8 else [0, 1, 2, 3]
    assert (logprobs[finite] - expected[finite]).abs().max() < 2e-4
    if vocab > 8:  # a NaN logit leaves no logprob, as in the portable loop
        assert logprobs[2].isnan()
