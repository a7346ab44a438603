"""The AVX2 loops of the fp32 panel matmul (pagoda_kernels/cpu/matmul_f32_avx2.c) on any CPU
with AVX2 and FMA: the kernels built a second time without AVX-512 (`build.load_variant`), so a
CPU with AVX-512, which runs matmul_f32.c's loops, checks them too. The panels are the ones the
AVX-512 build packs."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels.cpu import build
from tests.test_cpu_kernels import silu_and_mul


def _has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


# The skip of every test of an AVX2 loop (this file's, test_bf16_panels_avx2.py's,
# test_attention_avx2.py's).
NEEDS_AVX2_FMA = pytest.mark.skipif(not _has_avx2_fma() or build.load() is None,
                                    reason="the AVX2 loops need a CPU with AVX2 and FMA (and a C "
                                           "compiler)")
pytestmark = NEEDS_AVX2_FMA


@pytest.fixture(scope="module")
def avx2():
    lib = build.load_variant(["-mno-avx512f"])
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.matmul_f32_pack.argtypes = [p, i64, i64, i32, p]
    lib.matmul_f32.argtypes = [p, i64, i64, p, p, i64, i64, i32, p]
    lib.set_matmul_f32_rows.argtypes = [i32]
    lib.matmul_f32_rows_choice.argtypes = [i32]
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def test_avx2_build_runs_the_panels_in_blocks_of_4_or_6_rows(avx2):
    assert avx2.matmul_f32_available() == 1
    assert [avx2.matmul_f32_rows_choice(i) for i in range(3)] == [4, 6, 0]
    assert avx2.set_matmul_f32_rows(8) == -1  # the AVX-512 heights are not these


@pytest.mark.parametrize("height", [4, 6])
@pytest.mark.parametrize("gate_up", [False, True], ids=["plain", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_avx2_panel_matmul_equals_f_linear(avx2, height, gate_up, bias):
    g = torch.Generator().manual_seed(height + 2 * gate_up + 4 * bias)
    n, k = 96, 40
    weight = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = torch.empty(n * k)
    assert avx2.matmul_f32_pack(weight.data_ptr(), n, k, int(gate_up), packed.data_ptr()) == 0
    assert avx2.set_matmul_f32_rows(height) == 0
    for rows in (1, 5, 6, 7, 64, 257):
        wide = torch.randn(rows, k + 8, generator=g)
        x = wide[:, 8:8 + k]  # rows k + 8 apart
        out = torch.full((rows, n // 2 if gate_up else n), float("nan"))
        assert avx2.matmul_f32(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), _ptr(b), n, k,
                               int(gate_up), out.data_ptr()) == 0
        expected = F.linear(x, weight, b)
        if gate_up:
            expected = silu_and_mul(expected)
        scale = expected.abs().amax(-1, keepdim=True).clamp_min(1e-6)
        assert ((out - expected).abs() / scale).max() < 1e-5, rows


@pytest.mark.parametrize("gate_up", [False, True], ids=["plain", "gate_up"])
def test_avx2_panel_matmul_splits_long_rows_into_chunks_of_whole_blocks(avx2, gate_up):
    # x rows of 2,048 floats: 32 a chunk; of 12,000: one 6-row block a chunk (each chunk reads
    # every panel again, and the outputs are the same).
    g = torch.Generator().manual_seed(20 + gate_up)
    assert avx2.set_matmul_f32_rows(6) == 0
    for n, k, row_counts in ((64, 2048, (31, 64, 257)), (32, 12000, (5, 13))):
        weight = torch.randn(n, k, generator=g)
        packed = torch.empty(n * k)
        assert avx2.matmul_f32_pack(weight.data_ptr(), n, k, int(gate_up), packed.data_ptr()) == 0
        for rows in row_counts:
            x = torch.randn(rows, k, generator=g)
            out = torch.full((rows, n // 2 if gate_up else n), float("nan"))
            assert avx2.matmul_f32(x.data_ptr(), k, rows, packed.data_ptr(), None, n, k,
                                   int(gate_up), out.data_ptr()) == 0
            expected = F.linear(x, weight)
            if gate_up:
                expected = silu_and_mul(expected)
            scale = expected.abs().amax(-1, keepdim=True).clamp_min(1e-6)
            assert ((out - expected).abs() / scale).max() < 1e-5, (k, rows)


def test_avx2_panel_silu_and_mul_at_the_extremes(avx2):
    # One-hot x picks weight columns as the gate and up values: SiLU of gates from -100 to 100
    # (exp underflowing and overflowing) times up, as silu_and_mul computes it.
    n, k = 64, 32
    gates = torch.linspace(-100.0, 100.0, k)
    weight = torch.zeros(n, k)
    weight[:n // 2] = gates  # every gate column holds the same row of values
    weight[n // 2:] = 3.0
    packed = torch.empty(n * k)
    assert avx2.matmul_f32_pack(weight.data_ptr(), n, k, 1, packed.data_ptr()) == 0
    x = torch.eye(k)  # row i picks value i
    out = torch.empty(k, n // 2)
    assert avx2.matmul_f32(x.data_ptr(), k, k, packed.data_ptr(), None, n, k, 1,
                           out.data_ptr()) == 0
    expected = silu_and_mul(F.linear(x, weight))
    assert not out.isnan().any()
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_avx2_panel_matmul_refuses_partial_panels(avx2):
    x, out, w = torch.randn(2, 8), torch.empty(2, 48), torch.empty(48 * 8)
    assert avx2.matmul_f32(x.data_ptr(), 8, 2, w.data_ptr(), None, 48, 8, 0, out.data_ptr()) == -1
