"""The Triton top-k / top-p filter (pagoda_kernels/triton/top_k_top_p.py) against its torch reference
on a grid: one row and many, vocabularies that are not a multiple of the kernel's block, k and
p set per row (and unset on some), ties at the edges; each output poisoned with NaN before the
call. Then the sampler with the kernel chosen as on CUDA draws the tokens its sort path draws.
Without CUDA the kernel runs in Triton's interpreter on the CPU (TRITON_INTERPRET=1)."""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from pagoda_kernels.triton.top_k_top_p import top_k_top_p, top_k_top_p_reference  # noqa: E402
from services.worker import sampler as sampler_module  # noqa: E402
from services.worker.sampler import Sampler  # noqa: E402
from services.worker.sampling_metadata import SamplingRow, SamplingTensors  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
BLOCK = 128  # small, so that rows span several blocks and the last one is partial


def case(num_rows: int, vocab: int, ties: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g) * 2.5
    if ties:
        x = (x * 2).round() / 2  # a few dozen distinct values: tie groups at every edge
    # Per row: a middle k, no limit, small ones, k at the edge of the vocabulary.
    ks = [40, vocab, 1, 7, vocab - 1, vocab // 3]
    ps = [0.9, math.inf, 0.3, 0.999, 0.6, 1.0, 0.05]
    top_k = torch.tensor([ks[i % len(ks)] for i in range(num_rows)], dtype=torch.int64)
    top_p = torch.tensor([ps[i % len(ps)] for i in range(num_rows)], dtype=torch.float32)
    return x.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)


def mass_above(x: torch.Tensor, top_k: torch.Tensor | None) -> torch.Tensor:
    """Per logit: the probability (after top-k) of the logits strictly above it, float64."""
    kept = top_k_top_p_reference(x, top_k, None).double()
    probs = kept.softmax(dim=-1)
    return torch.stack([(probs[r][None, :] * (kept[r][None, :] > kept[r][:, None])).sum(-1)
                        for r in range(x.shape[0])])


@pytest.mark.parametrize("num_rows,vocab,ties", [(1, 300, False), (6, 300, True),
                                                 (7, 257, False)])
@pytest.mark.parametrize("filters", ["top_k", "top_p", "both"])
def test_kernel_matches_the_reference(num_rows, vocab, ties, filters):
    x, top_k, top_p = case(num_rows, vocab, ties, seed=num_rows * vocab)
    top_k = top_k if filters in ("top_k", "both") else None
    top_p = top_p if filters in ("top_p", "both") else None
    x_before = x.clone()
    out = torch.full_like(x, float("nan"))
    got = top_k_top_p(x, top_k, top_p, out=out, block=BLOCK)
    expected = top_k_top_p_reference(x, top_k, top_p)
    assert got is out
    assert not torch.isnan(got).any(), "a value was never written"
    assert torch.equal(x, x_before), "x changed although out was given"
    differ = got.ne(expected)
    if top_p is None:
        assert not differ.any(), "top-k is an exact search: it must agree everywhere"
    elif differ.any():
        # The kernel sums its masses in float32 in another order: only a logit whose mass above
        # lies within rounding of p may land on the other side.
        rows, cols = differ.nonzero(as_tuple=True)
        near = (mass_above(x, top_k)[rows, cols] - top_p.double()[rows]).abs()
        assert near.max().item() < 1e-5, (rows.tolist(), cols.tolist(), near.tolist())
    kept = (expected > float("-inf")).sum(-1)
    # The grid means something: the filters cut, and rows without a limit keep everything.
    assert (kept < vocab).any()
    if filters == "top_k":
        assert kept[top_k >= vocab].eq(vocab).all()
        assert (kept >= top_k.clamp(max=vocab)).all()  # ties at the k-th value are kept
    if filters == "top_p":
        assert kept[top_p >= 1.0].eq(vocab).all()


def test_in_place_and_ties_kept_whole():
    # One row of [3, 2, 2, 2, 1, ...]: k = 2 cuts inside the tie group of 2s, which stays whole;
    # p just above the 3's mass reaches into the group, which again stays whole.
    vocab = 200
    x = torch.full((2, vocab), -4.0)
    x[:, 0], x[:, 1:4] = 3.0, 2.0
    x = x.to(DEVICE)
    p_first = (x[0].softmax(-1)[0].item() + 0.01)
    top_k = torch.tensor([2, vocab], device=DEVICE)
    top_p = torch.tensor([math.inf, p_first], device=DEVICE)
    expected = top_k_top_p_reference(x, top_k, top_p)
    got = top_k_top_p(x, top_k, top_p, out=x, block=BLOCK)  # in place
    assert got is x and torch.equal(got, expected)
    assert (got > float("-inf")).sum(-1).tolist() == [4, 4]

    # -0.0 and 0.0 compare equal: a tie group like any other.
    x = torch.tensor([[1.0, 0.0, -0.0, -1.0, 0.0, -2.0]] * 2, device=DEVICE)
    top_k = torch.tensor([2, 6], device=DEVICE)
    top_p = torch.tensor([math.inf, 0.5], device=DEVICE)
    got = top_k_top_p(x, top_k, top_p, block=BLOCK)
    assert torch.equal(got, top_k_top_p_reference(x, top_k, top_p))
    assert (got > float("-inf")).sum(-1).tolist() == [4, 4]


def sampling_rows(num_rows: int, vocab: int) -> list[SamplingRow]:
    rows = []
    for i in range(num_rows):
        params = SamplingParams(temperature=0.8 + 0.1 * (i % 3), top_k=[0, 5, 50][i % 3],
                                top_p=[0.7, 1.0, 0.95, 0.4][i % 4], seed=i)
        rows.append(SamplingRow(params=params, seed=i, sample_index=0, output_index=i,
                                prompt_token_ids=[], output_token_ids=[]))
    return rows


def test_sampler_on_the_kernel_draws_what_the_sort_path_draws(monkeypatch):
    """The sampler's dispatch: with the kernel chosen (as it is for CUDA tensors), the same
    tokens as the CPU's own path for logits without ties."""
    vocab, num_rows = 1500, 6  # more than the CPU path's 1024 candidates
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(num_rows, vocab, generator=g) * 3).to(DEVICE)
    tensors = SamplingTensors.from_rows(sampling_rows(num_rows, vocab), vocab, DEVICE)
    assert tensors.top_k is not None and tensors.top_p is not None
    expected = Sampler()(logits.cpu(), SamplingTensors.from_rows(
        sampling_rows(num_rows, vocab), vocab, "cpu")).token_ids
    calls = []

    def chosen(x):
        calls.append(x.shape)
        return True
    monkeypatch.setattr(sampler_module, "_filters_in_triton", chosen)
    got = Sampler()(logits, tensors).token_ids
    assert calls, "the sampler did not ask for the kernel"
    assert got.cpu().tolist() == expected.tolist()
