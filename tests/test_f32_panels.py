"""The fp32 panel matmul (pagoda_kernels/cpu/matmul_f32.c, matmul_f32_avx2.c): x W^T (+ bias),
and SiLU(gate) * up for a gate/up weight, at each block height, against torch at the row counts of decode steps and prompts; what it does not
take goes to oneDNN; the LM head takes it where the fp32 layout says panels (the layer modules:
tests/test_cpu_kernels.py, test_fp32_layer_weights_packed_as_the_chosen_layout)."""
import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels import cpu as cpu_kernels
from services.worker.models import linear as linear_module
from services.worker.models.linear import linear, pack_weight
from tests.test_cpu_kernels import silu_and_mul

pytestmark = pytest.mark.skipif(not cpu_kernels.f32_matmul_available(),
                                reason="the fp32 panel matmul needs a CPU with AVX-512 or AVX2 "
                                       "and FMA (and the C kernels built)")


@pytest.fixture
def panels_layout():
    """fp32 weights packed into panels for one test; the process's layout put back after."""
    before = linear_module._fp32_layout
    linear_module.set_fp32_layout("panels")
    yield
    linear_module.set_fp32_layout(before)


def close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to the summation order: relative to the row's largest value."""
    scale = expected.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    return bool(((out - expected).abs() / scale).max() < 1e-5)


@pytest.fixture(params=[0, 1], ids=["lower_blocks", "taller_blocks"])
def block_rows(request):
    """Each block height this build runs, for one test; the process's height put back after."""
    heights = cpu_kernels.f32_block_rows()
    assert len(heights) == 2
    linear_module.fp32_layout()  # the process's height, timed first
    before = cpu_kernels.f32_block_rows_now()
    cpu_kernels.set_f32_block_rows(heights[request.param])
    yield heights[request.param]
    cpu_kernels.set_f32_block_rows(before)


@pytest.mark.parametrize("gate_up", [False, True], ids=["plain", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("k", [32, 40, 576])
def test_f32_panel_linear_equals_f_linear(k, bias, gate_up, block_rows):
    g = torch.Generator().manual_seed(k + 2 * bias + gate_up)
    n = 96
    weight = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_kernels.pack_f32_weight(weight, gate_up=gate_up)
    assert packed is not None and packed.numel() == n * k
    for rows in (1, 7, 8, 9, 31, 64, 255, 257, 600):
        wide = torch.randn(rows, k + 16, generator=g)
        for x in (wide[:, :k].contiguous(), wide[:, 16:16 + k]):  # the second at a row stride
            out = cpu_kernels.f32_linear(x, packed, b, n, gate_up)
            expected = F.linear(x, weight, b)
            if gate_up:
                expected = silu_and_mul(expected)
            assert out.shape == expected.shape and out.dtype == torch.float32
            assert not out.isnan().any()
            assert close(out, expected), rows


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_f32_panel_logits_stored_around_the_caches_are_the_cached_stores_bits(bias):
    # 16,384 columns from 128 rows (8 MiB) are streamed (matmul_f32.c, STREAM_MIN_*); the same
    # rows a few at a time are not, and each row's sums run in the same order either way.
    g = torch.Generator().manual_seed(16)
    n, k = 16384, 64
    weight = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_kernels.pack_f32_weight(weight)
    x = torch.randn(160, k, generator=g)
    streamed = cpu_kernels.f32_linear(x, packed, b, n, False)
    assert streamed.data_ptr() % 64 == 0  # what streaming asks of the output
    cached = torch.cat([cpu_kernels.f32_linear(x[i:i + 8], packed, b, n, False)
                        for i in range(0, 160, 8)])
    assert torch.equal(streamed, cached)
    assert close(streamed, F.linear(x, weight, b))


def test_f32_panel_silu_and_mul_at_the_extremes():
    """Gates far into SiLU's tails (exp overflowing and underflowing) and at zero: identity
    weights make the gate and up halves equal x, so the result is SiLU(x) * x."""
    eye = torch.eye(32)
    weight = torch.cat((eye, eye))  # [gate; up], both the identity
    values = torch.tensor([-3e38, -200.0, -104.0, -90.0, -88.0, -20.0, -1.0, -0.5, 0.0, 0.5, 1.0,
                           20.0, 88.0, 90.0, 200.0, 1e30])
    x = torch.cat((values, -values)).unsqueeze(0)
    out = cpu_kernels.f32_linear(x, cpu_kernels.pack_f32_weight(weight, gate_up=True), None, 64,
                                 True)
    expected = F.silu(x) * x
    assert torch.equal(out.isinf(), expected.isinf())
    assert torch.equal(out.isnan(), expected.isnan())
    finite = expected.isfinite()
    assert torch.allclose(out[finite], expected[finite], rtol=1e-6, atol=0)


def test_f32_panel_linear_keeps_leading_dims_and_refuses_what_does_not_fit():
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 32, generator=g)
    packed = cpu_kernels.pack_f32_weight(weight)
    x = torch.randn(3, 5, 32, generator=g)
    out = cpu_kernels.f32_linear(x, packed, None, 64)
    assert out.shape == (3, 5, 64) and close(out, F.linear(x, weight))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.f32_linear(torch.randn(4, 64), packed, None, 64)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.f32_linear(torch.randn(4, 32).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(ValueError, match="bias"):
        cpu_kernels.f32_linear(torch.randn(4, 32), packed, torch.randn(63), 64)
    with pytest.raises(ValueError, match="packed weight is"):
        cpu_kernels.f32_linear(torch.randn(4, 32), packed.to(torch.bfloat16), None, 64)


def test_f32_panels_take_fp32_weights_of_whole_panels_only():
    assert cpu_kernels.pack_f32_weight(torch.randn(48, 64)) is None  # N not a multiple of 32
    assert cpu_kernels.pack_f32_weight(torch.randn(64, 64).to(torch.bfloat16)) is None
    assert cpu_kernels.pack_f32_weight(torch.randn(64, 64, device="meta")) is None
    cpu_kernels.set_f32_matmul(False)
    try:
        assert cpu_kernels.pack_f32_weight(torch.randn(64, 64)) is None
    finally:
        cpu_kernels.set_f32_matmul(True)


def test_fp32_lm_head_takes_panels_where_that_is_the_layout(panels_layout):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(1024, 64, generator=g)
    packed = pack_weight(weight, (torch.bfloat16, torch.float32))
    assert packed.kind == "f32"
    x = torch.randn(3, 64, generator=g)
    assert close(linear(x, weight, None, packed), F.linear(x, weight))
    # A shape the panels do not take goes to oneDNN (where torch has it), as with another layout.
    other = pack_weight(torch.randn(1000, 64, generator=g), (torch.bfloat16, torch.float32))
    if linear_module._onednn(torch.float32):
        assert other.kind == "onednn"
    else:
        assert other is None
