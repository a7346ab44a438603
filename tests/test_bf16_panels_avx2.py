"""The AVX2 loops of the bf16 panel matmul (pagoda_kernels/cpu/matmul_bf16_avx2.c) on any CPU
with AVX2 and FMA: the kernels built a second time without AVX-512 (`build.load_variant`), so a
CPU with AVX-512, whose own build runs matmul_bf16.c's loops or leaves bf16 to oneDNN, checks
them too. Both of its loops: on
the packed tiles (chunks of fewer than 24 rows) and on tiles widened to fp32 (24 or more)."""

import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels.cpu import bind, build
from pagoda_kernels.cpu.bind import data_ptr as _ptr
from tests.test_cpu_kernels import bf16_step, bf16_ulps, silu_and_mul, summation_slack
from tests.test_f32_panels_avx2 import NEEDS_AVX2_FMA

pytestmark = NEEDS_AVX2_FMA


@pytest.fixture(scope="module")
def avx2():
    lib = build.load_variant(["-mno-avx512f"])
    for name in ("matmul_bf16_pack", "matmul_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = bind._SIGNATURES[name]
    return lib


def _run(lib, x, weight, bias, gate_up):
    n, k = weight.shape
    packed = torch.empty(n * k, dtype=torch.bfloat16)
    assert lib.matmul_bf16_pack(weight.data_ptr(), n, k, int(gate_up), packed.data_ptr()) == 0
    out = torch.full((x.shape[0], n // 2 if gate_up else n), float("nan"), dtype=torch.bfloat16)
    assert lib.matmul_bf16(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), _ptr(bias),
                           n, k, int(gate_up), out.data_ptr()) == 0
    return out


def _check(out, x, weight, bias, gate_up):
    """As the bf16 model computes it (F.linear in bf16, then SiLU and the product rounded): a
    rounding may move by a bf16 step in another summation order (two through the fused SiLU),
    more only within what two fp32 sums of these terms can differ by."""
    expected = F.linear(x, weight, bias)
    if gate_up:
        expected = silu_and_mul(expected)
    steps = 2 if gate_up else 1
    step = torch.maximum(bf16_step(out), bf16_step(expected))
    slack = summation_slack(x, weight, bias, gate_up) + steps * step
    far = (bf16_ulps(out, expected) > steps) & ((out.double() - expected.double()).abs() > slack)
    assert not far.any(), (out[far], expected[far])
    assert (out == expected).float().mean() > 0.97


def test_avx2_build_runs_the_bf16_avx2_loop(avx2):
    assert avx2.matmul_bf16_path() == 3
    assert avx2.matmul_amx_available() == 0


@pytest.mark.parametrize("gate_up", [False, True], ids=["plain", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_avx2_bf16_panel_matmul_equals_f_linear(avx2, gate_up, bias):
    g = torch.Generator().manual_seed(2 * gate_up + bias)
    n, k = 96, 64
    weight = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    # 1-23 rows on the packed tiles in blocks of 4; 24 and more widened, in blocks of 6 (26, 27:
    # last blocks of 2 and 3 rows)
    for rows in (1, 3, 4, 5, 9, 23, 24, 25, 26, 27, 64, 257):
        wide = torch.randn(rows, k + 32, generator=g).to(torch.bfloat16)
        x = wide[:, 32:32 + k]  # rows k + 32 apart
        _check(_run(avx2, x, weight, b, gate_up), x, weight, b, gate_up)


@pytest.mark.parametrize("gate_up", [False, True], ids=["plain", "gate_up"])
def test_avx2_bf16_panel_matmul_splits_long_rows_into_chunks(avx2, gate_up):
    # x rows of 2,048 values (8 KiB widened): 36 rows a chunk, widened; of 12,032: one 6-row
    # block a chunk, too few rows to widen, on the tiles (each chunk reads every panel again).
    g = torch.Generator().manual_seed(30 + gate_up)
    for n, k, row_counts in ((64, 2048, (31, 64, 257)), (32, 12032, (5, 13, 30))):
        weight = (torch.randn(n, k, generator=g) * 0.03).to(torch.bfloat16)
        for rows in row_counts:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            _check(_run(avx2, x, weight, None, gate_up), x, weight, None, gate_up)


@pytest.mark.parametrize("rows", [1, 32], ids=["tiles", "widened"])
def test_avx2_bf16_silu_and_mul_at_the_extremes(avx2, rows):
    # The identity as both gate and up: SiLU(v) * v for values whose exp underflows and
    # overflows, as the bf16 model rounds it; infinities where it has them.
    eye = torch.eye(32)
    weight = torch.cat((eye, eye)).to(torch.bfloat16)
    values = torch.tensor([-3e38, -200.0, -104.0, -90.0, -88.0, -20.0, -1.0, -0.5, 0.0, 0.5, 1.0,
                           20.0, 88.0, 90.0, 200.0, 1e30])
    x = torch.cat((values, -values)).to(torch.bfloat16).expand(rows, 32).contiguous()
    out = _run(avx2, x, weight, None, True)
    expected = silu_and_mul(F.linear(x, weight))
    assert torch.equal(out.isinf(), expected.isinf()) and not out.isnan().any()
    finite = expected.isfinite()
    assert bf16_ulps(out[finite], expected[finite]).max() <= 1


def test_avx2_bf16_panel_matmul_refuses_partial_panels(avx2):
    x = torch.randn(2, 32).to(torch.bfloat16)
    out, w = torch.empty(2, 48, dtype=torch.bfloat16), torch.empty(48 * 32, dtype=torch.bfloat16)
    assert avx2.matmul_bf16(x.data_ptr(), 32, 2, w.data_ptr(), None, 48, 32, 0,
                            out.data_ptr()) == -1
    x = torch.randn(2, 40).to(torch.bfloat16)  # K not a multiple of 32 either
    assert avx2.matmul_bf16(x.data_ptr(), 40, 2, w.data_ptr(), None, 32, 40, 0,
                            out.data_ptr()) == -1
