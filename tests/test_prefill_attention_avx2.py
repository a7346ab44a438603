"""Prefill attention's AVX2 loop (pagoda_kernels/cpu/prefill_attention_avx2.c) on any CPU with AVX2
and FMA: the kernels built a second time without AVX-512 (`build.load_variant`), so a CPU with
AVX-512, whose default build runs the AVX-512 loop, checks it too. (Without AVX-512,
tests/test_prefill_attention_cpu.py's "avx2" cases run this loop as well.)"""
import pytest
import torch

from pagoda_kernels import reference
from pagoda_kernels.cpu import bind, build
from tests.test_f32_panels_avx2 import NEEDS_AVX2_FMA
from tests.test_prefill_attention_cpu import packed

pytestmark = NEEDS_AVX2_FMA

# (lengths, heads, kv_heads, head_dim): prompts of 1 token, prompts ending mid-block (16 keys)
# and mid-item (32 queries), blocks straddling two prompts, query blocks with fewer than the 4
# rows the loop takes together, groups of 1 to 8, both head dims.
CASES = [
    ([1], 9, 3, 64),
    ([77], 9, 3, 64),
    ([1, 16, 33, 5, 64, 2, 31], 9, 3, 64),
    ([3, 130, 17], 8, 8, 128),
    ([40, 1, 2, 3, 95], 4, 1, 128),
    ([250, 7], 8, 1, 64),
]
IDS = [f"{len(c[0])}seqs-{c[1]}h{c[2]}kv-d{c[3]}" for c in CASES]


@pytest.fixture(scope="module")
def avx2():
    lib = build.load_variant(["-mno-avx512f"])
    for suffix in ("f32", "bf16"):
        fn = getattr(lib, f"causal_prefill_{suffix}")
        fn.argtypes, fn.restype = bind._SIGNATURES["causal_prefill"]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # items handed out to more than one thread, whatever the machine
    yield lib
    torch.set_num_threads(threads)


def _run(lib, q, k, v, starts, scale: float, simd: bool) -> torch.Tensor:
    """The variant's entry, as pagoda_kernels.cpu.causal_prefill_attention calls it."""
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()
               for t in (q, k, v))
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    fn = lib.causal_prefill_f32 if q.dtype == torch.float32 else lib.causal_prefill_bf16
    lib.set_prefill_simd(int(simd))
    try:
        rc = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                starts.data_ptr(), starts.shape[0] - 1, q.shape[0], q.shape[1], k.shape[1],
                q.shape[2], scale, out.data_ptr())
    finally:
        lib.set_prefill_simd(1)
    assert rc == 0
    return out


def test_the_build_without_avx512_has_the_avx2_loop(avx2):
    assert avx2.prefill_simd_available() == 1  # 2 would be the AVX-512 loop


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_avx2_prefill_fp32_equals_the_reference(avx2, case):
    lengths, heads, kv_heads, head_dim = case
    q, k, v, starts = packed(lengths, heads, kv_heads, head_dim, torch.float32)
    scale = head_dim ** -0.5
    out = _run(avx2, q, k, v, starts, scale, simd=True)
    assert not out.isnan().any()  # every row written
    expected = reference.causal_prefill_attention(q, k, v, starts, max(lengths), scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_avx2_prefill_bf16_is_fp32_attention_rounded_once(avx2, case):
    lengths, heads, kv_heads, head_dim = case
    q, k, v, starts = packed(lengths, heads, kv_heads, head_dim, torch.bfloat16)
    scale = head_dim ** -0.5
    out = _run(avx2, q, k, v, starts, scale, simd=True)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    # Against fp32 attention over the same bf16 values the only error is the final rounding.
    exact = reference.causal_prefill_attention(q.float(), k.float(), v.float(), starts,
                                               max(lengths), scale)
    error = (out.float() - exact).abs()
    assert (error <= exact.abs() * 2 ** -8 + 1e-5).all(), error.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_prefill_over_many_blocks_with_a_moving_maximum_agrees_with_the_portable_loop(
        avx2, dtype):
    """Peaked scores, so that late key blocks often hold a new running maximum (the rescaling of
    the accumulators), over a prompt of 44 blocks beside short ones."""
    q, k, v, starts = packed([3, 700, 41], 9, 3, 64, dtype, seed=1)
    q = q * 4
    vector = _run(avx2, q, k, v, starts, 0.125, simd=True)
    portable = _run(avx2, q, k, v, starts, 0.125, simd=False)
    exact = reference.causal_prefill_attention(q.float(), k.float(), v.float(), starts, 700,
                                               0.125)
    tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2,
                                                                               rtol=2e-2)
    torch.testing.assert_close(vector.float(), exact, **tolerance)
    torch.testing.assert_close(vector.float(), portable.float(), **tolerance)


def test_avx2_prefill_of_prompts_packed_together_equals_each_prompt_alone(avx2):
    """Prompts packed back to back share key blocks; each one's rows see only its own keys."""
    lengths = [20, 13, 30]
    q, k, v, starts = packed(lengths, 9, 3, 64, torch.float32)
    together = _run(avx2, q, k, v, starts, 0.125, simd=True)
    for i, length in enumerate(lengths):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        alone = _run(avx2, q[rows], k[rows], v[rows], torch.tensor([0, length]), 0.125,
                     simd=True)
        torch.testing.assert_close(together[rows], alone, atol=1e-6, rtol=1e-6)
