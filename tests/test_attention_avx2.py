"""Decode attention's AVX2 loop (pagoda_kernels/cpu/paged_attention_avx2.c) on any CPU with AVX2
and FMA: the kernels built a second time without AVX-512 (`build.load_variant`), so a CPU with
AVX-512, whose default build runs paged_attention_avx512.c, checks it too. (Without AVX-512,
tests/test_cpu_kernels.py's "simd" cases run this loop as well.)"""
import pytest
import torch

from pagoda_kernels import reference
from pagoda_kernels.cpu import bind, build
from tests.test_cpu_kernels import PagedCase
from tests.test_f32_panels_avx2 import NEEDS_AVX2_FMA

pytestmark = NEEDS_AVX2_FMA

# (num_kv_heads, group, head_dim, block_size, seq_lens): every group the loop takes at head_dim
# 64 and 128; block sizes not a multiple of its 8-token tile; a sequence ending mid-tile; a batch
# of 16 with several KV heads, which a work item takes together at 2 threads (the fixture's).
CASES = [
    (2, 1, 64, 16, [1, 16, 17, 7]),
    (3, 3, 64, 16, [1, 8, 9, 200, 33]),
    (1, 4, 128, 8, [9, 8, 1, 64]),
    (2, 8, 128, 32, [33, 600, 32]),
    (2, 5, 64, 12, [13, 25, 11, 40]),
    (1, 6, 128, 128, [128, 129, 5]),
    (1, 7, 64, 8, [3, 70]),
    (1, 2, 64, 32, [1, 31, 32, 33, 200, 7, 64, 65, 16, 17, 3, 90, 128, 129, 5, 40]),
    (4, 3, 64, 16, [16, 1, 17, 300, 15, 2, 48, 49, 33, 8, 100, 64, 1, 19, 77, 31]),
]
IDS = [f"kv{kv}-g{g}-d{d}-b{b}" for kv, g, d, b, _ in CASES]


@pytest.fixture(scope="module")
def avx2():
    lib = build.load_variant(["-mno-avx512f"])
    for name, suffix in (("paged_decode", "f32"), ("paged_decode", "bf16")):
        fn = getattr(lib, f"{name}_{suffix}")
        fn.argtypes, fn.restype = bind._SIGNATURES[name]
    # Items of several KV heads need 4 sequences a thread (kv_heads_per_item): 2 threads, the
    # same OpenMP runtime torch sets, whatever the machine has.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield lib
    torch.set_num_threads(threads)


def _run(lib, c: PagedCase, simd: bool) -> torch.Tensor:
    query, key_cache, value_cache, block_tables, seq_lens, _, scale = c.args()
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
    fn = lib.paged_decode_f32 if query.dtype == torch.float32 else lib.paged_decode_bf16
    lib.set_attention_simd(int(simd))
    try:
        rc = fn(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                out.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale)
    finally:
        lib.set_attention_simd(1)
    assert rc == 0
    return out


def test_the_build_without_avx512_has_the_avx2_loop(avx2):
    assert avx2.attention_simd_available() == 1  # 2 would be the AVX-512 loop


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_avx2_decode_attention_fp32_equals_the_reference(avx2, case):
    num_kv_heads, group, head_dim, block_size, lens = case
    c = PagedCase(lens, num_kv_heads, group, head_dim, block_size, torch.float32)
    expected = reference.paged_decode_attention(*c.args())
    torch.testing.assert_close(_run(avx2, c, True), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_avx2_decode_attention_bf16_is_fp32_attention_rounded_once(avx2, case):
    num_kv_heads, group, head_dim, block_size, lens = case
    c = PagedCase(lens, num_kv_heads, group, head_dim, block_size, torch.bfloat16)
    out = _run(avx2, c, True)
    assert out.dtype == torch.bfloat16
    # Against fp32 attention over the same bf16 values the only error is the final rounding.
    exact = reference.paged_decode_attention(*c.args(torch.float32))
    error = (out.float() - exact).abs()
    assert (error <= exact.abs() * 2 ** -8 + 1e-5).all(), error.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_decode_attention_reads_only_each_sequences_own_tokens(avx2, dtype):
    """NaN in every slot no sequence owns leaves the output finite and unchanged; and the loop
    agrees with the portable one."""
    c = PagedCase([1, 17, 40, 16, 5, 33, 2, 64] * 2, 2, 4, 64, 16, dtype)
    expected = _run(avx2, c, True)
    free = ~c.used_slots()
    c.key_cache[free] = float("nan")
    c.value_cache[free] = float("nan")
    out = _run(avx2, c, True)
    assert torch.isfinite(out).all()
    assert torch.equal(out, expected)
    portable = _run(avx2, c, False)
    torch.testing.assert_close(out.float(), portable.float(), atol=1e-2 if dtype != torch.float32
                               else 1e-5, rtol=1.6e-2 if dtype != torch.float32 else 1e-5)
