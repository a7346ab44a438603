"""pagoda_kernels/cpu/matmul_int8.c: every path this CPU has (weight-only int8 and w8a8) against a
dequantized torch reference, on a grid of shapes with K and N that are not multiples of the
kernel's 64 / 32, outputs poisoned with NaN so that an element left unwritten shows. A path the
CPU lacks is reported skipped."""
import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.int8_kernels_available(),
                                reason=f"cpu kernels unavailable: "
                                       f"{cpu_kernels.build.unavailable_reason()}")

# Below, at and past the AMX threshold (16); 130: whole 32-row tiles, 8-row VNNI / FMA blocks
# and 4-row fixed-point blocks, and a tail of each.
ROWS = [1, 3, 16, 17, 130]
SHAPES = [(64, 64), (100, 33), (48, 100), (576, 1536)]  # (K, N)
# (mode, path): the paths each mode has (w8a8 has no plain AVX-512 path).
MODE_PATHS = [("int8", "portable"), ("int8", "avx512"), ("int8", "vnni"), ("int8", "amx"),
              ("w8a8", "portable"), ("w8a8", "vnni"), ("w8a8", "amx")]
DTYPES = [torch.bfloat16, torch.float32]
# Weight-only AMX takes bf16 activations only (fp32 is refused: the last test).
CASES = [(m, p, d) for m, p in MODE_PATHS for d in DTYPES
         if not (m, p, d) == ("int8", "amx", torch.float32)]
CASE_IDS = [f"{m}-{p}-{'bf16' if d == torch.bfloat16 else 'fp32'}" for m, p, d in CASES]


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, k] int8 over the whole range and scales of very different sizes."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.logspace(-4, -1, n) * (1 + torch.rand(n, generator=g))).float()
    return q, scale


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, w8a8: bool) -> torch.Tensor:
    """fp32 x (w8a8: quantized per row as the kernel does, round(x * (1 / s))) @ (q s)^T + b."""
    xf = x.float()
    if w8a8:
        s = xf.abs().amax(dim=1, keepdim=True) / 127.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        xf = torch.round(xf * (1.0 / s)).clamp(-127, 127) * s
    out = xf.double() @ (q.double() * scale.double()[:, None]).T
    if bias is not None:
        out += bias.double()
    return out.float()


def _skip_unless_here(mode: str, path: str, dtype: torch.dtype) -> None:
    here = cpu_kernels.int8_paths(mode == "w8a8")
    if path not in here:
        pytest.skip(f"this CPU (or build) has no {path} path for {mode} (here: {here})")


def _tolerance(dtype: torch.dtype, mode: str, ref: torch.Tensor) -> float:
    # bf16: the output's rounding, 2^-8 of its size. fp32 weight-only: summation order (and on
    # VNNI x's 24-bit fixed point, up to 2^-23 of its row's largest).
    # fp32 w8a8: also x * (1 / s) one ulp off torch's now and then, which moves a q by one.
    rel = {torch.bfloat16: 8e-3, torch.float32: 2e-5 if mode == "int8" else 1e-3}[dtype]
    return rel * ref.abs().max().item()


def _run(x, packed, scale, sums, bias, n, mode, path, gate_up=False):
    out_cols = n // 2 if gate_up else n
    out = torch.full((x.shape[0], out_cols), float("nan"), dtype=x.dtype)
    got = cpu_kernels.int8_linear(x, packed, scale, sums, bias, n, x.shape[1], gate_up,
                                  mode == "w8a8", path, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any(), f"{torch.isnan(out).sum().item()} elements not written"
    return out


@pytest.mark.parametrize("mode,path,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("k,n", SHAPES)
def test_int8_matmul_matches_the_dequantized_reference(k, n, mode, path, dtype):
    _skip_unless_here(mode, path, dtype)
    q, scale = _weight(n, k, seed=k * 1000 + n)
    packed = cpu_kernels.pack_int8_weight(q)
    assert torch.equal(cpu_kernels.unpack_int8_weight(packed, n, k), q)
    sums = q.sum(dim=1, dtype=torch.int32)
    for m in ROWS:
        torch.manual_seed(m)
        x = (torch.randn(m, k) * torch.logspace(-1, 1, m)[:, None]).to(dtype)  # row scales vary
        if m > 2:
            x[0] = 0  # an all-zero row (scale 1 in w8a8)
        bias = torch.randn(n).to(dtype) if m % 2 else None
        ref = _reference(x, q, scale, bias, mode == "w8a8")
        out = _run(x, packed, scale, sums, bias, n, mode, path)
        err = (out.float() - ref).abs().max().item()
        tol = _tolerance(dtype, mode, ref)
        assert err <= tol, f"{m} rows: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("mode,path,dtype", CASES, ids=CASE_IDS)
def test_int8_gate_up_epilogue_is_silu_gate_times_up(mode, path, dtype):
    """[gate; up] packed with gate_up: the kernel returns SiLU(gate) * up, including halves
    that are not a multiple of the 16-column tile (40)."""
    _skip_unless_here(mode, path, dtype)
    for k, half in [(64, 96), (100, 40)]:
        n = 2 * half
        q, scale = _weight(n, k, seed=k + half)
        packed = cpu_kernels.pack_int8_weight(q, gate_up=True)
        assert torch.equal(cpu_kernels.unpack_int8_weight(packed, n, k, gate_up=True), q)
        sums = q.sum(dim=1, dtype=torch.int32)
        for m in (1, 3, 17, 64):
            torch.manual_seed(m)
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n).to(dtype) if m % 2 else None
            gate, up = _reference(x, q, scale, bias, mode == "w8a8").chunk(2, dim=-1)
            ref = F.silu(gate) * up
            out = _run(x, packed, scale, sums, bias, n, mode, path, gate_up=True)
            assert out.shape == (m, half)
            err = (out.float() - ref).abs().max().item()
            # bf16 rounds gate, up and SiLU as the bf16 model does: three roundings.
            tol = (1.5e-2 if dtype == torch.bfloat16 else 1e-3) * ref.abs().max().item()
            assert err <= tol, f"K {k}, {m} rows: max error {err:.3g} > {tol:.3g}"


def test_int8_matmul_refuses_what_a_path_cannot_run():
    q, scale = _weight(64, 64, seed=1)
    packed = cpu_kernels.pack_int8_weight(q)
    x = torch.randn(2, 64)
    sums = q.sum(dim=1, dtype=torch.int32)
    # weight-only VNNI without the weight sums; w8a8 has no AVX-512 path; AMX with fp32 x
    for w8a8, path, s in [(False, "vnni", None), (True, "avx512", sums), (False, "amx", sums)]:
        with pytest.raises(RuntimeError, match=f"path '{path}' does not run here"):
            cpu_kernels.int8_linear(x, packed, scale, s, None, 64, 64, w8a8=w8a8, path=path)
    with pytest.raises(ValueError, match="does not fit a packed weight"):
        cpu_kernels.int8_linear(torch.randn(2, 65), packed, scale, None, None, 64, 64)
    with pytest.raises(ValueError, match="gate_up weight needs an even number"):
        cpu_kernels.pack_int8_weight(q[:63], gate_up=True)
    with pytest.raises(ValueError, match="weight_sums must be contiguous int32"):
        cpu_kernels.int8_linear(x, packed, scale, None, None, 64, 64, w8a8=True)


def test_int8_matmul_refuses_x_of_another_k_in_the_same_step_of_64():
    """K = 100 and K = 128 pack into the same number of bytes: x's K is checked against the
    weight's own, so 28 columns of x never meet the weight's zero padding."""
    q, scale = _weight(64, 100, seed=2)
    packed = cpu_kernels.pack_int8_weight(q)
    assert packed.numel() == cpu_kernels.pack_int8_weight(torch.zeros(64, 128,
                                                                      dtype=torch.int8)).numel()
    with pytest.raises(ValueError, match=r"x \(2, 128\).* weight of 64 x 100"):
        cpu_kernels.int8_linear(torch.randn(2, 128), packed, scale, None, None, 64, 100)
    out = cpu_kernels.int8_linear(torch.randn(2, 100), packed, scale, None, None, 64, 100)
    assert out.shape == (2, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_int8_vnni_fixed_point_is_exact_for_values_within_2_to_the_15_of_the_rows_largest(dtype):
    """The weight-only VNNI path's fixed point has a power-of-two step: with one weight of 1 per
    column (q the identity, scale 1), y = x exactly for every bf16-representable x of at least
    2^-15 of its row's largest, in fp32 and bf16, including a largest that is a power of two;
    smaller values are rounded to a multiple of the step 2^(e - 23)."""
    _skip_unless_here("int8", "vnni", dtype)
    k = 128
    q = torch.eye(k, dtype=torch.int8)
    packed = cpu_kernels.pack_int8_weight(q)
    scale, sums = torch.ones(k), q.sum(dim=1, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    # Row r: its largest `top` (bf16 values), the others 2^-15 .. 1 of it: random 8-bit
    # mantissas and signs.
    tops = torch.tensor([3.0, 0.69921875, 2.0, 0.0050048828125, 1.9921875])
    assert torch.equal(tops.bfloat16().float(), tops)
    ratio = 2.0 ** -torch.randint(0, 15, (len(tops), k - 1), generator=g).float()
    mantissa = 1 + torch.randint(0, 128, (len(tops), k - 1), generator=g).float() / 128
    sign = torch.randint(0, 2, (len(tops), k - 1), generator=g).float() * 2 - 1
    x = torch.cat([tops[:, None], sign * mantissa * ratio * tops[:, None] / 2], dim=1)
    x = x.bfloat16().float()  # representable in bf16 (rounding keeps them >= top 2^-15)
    assert (x.abs() >= tops[:, None] * 2.0 ** -15).all() and torch.equal(x.abs().amax(1), tops)
    out = cpu_kernels.int8_linear(x.to(dtype), packed, scale, sums, None, k, k, path="vnni")
    assert torch.equal(out.float(), x), (out.float() - x).abs().max()
    # Below 2^-15 of the largest: a multiple of the step, at most half a step off.
    tiny = x.clone()
    tiny[:, 1:] = sign * mantissa * tops[:, None] * 2.0 ** -20
    tiny = tiny.bfloat16().float()
    step = torch.tensor([2.0 ** (torch.frexp(t).exponent.item() - 23) for t in tops])[:, None]
    out = cpu_kernels.int8_linear(tiny.to(dtype), packed, scale, sums, None, k, k,
                                  path="vnni").float()
    if dtype == torch.float32:
        assert torch.equal(torch.round(out / step) * step, out)
        assert ((out - tiny).abs() <= step / 2).all()
    else:  # then rounded to bf16
        assert ((out - tiny).abs() <= step + tiny.abs() * 2.0 ** -7).all()


@pytest.mark.parametrize("path", ["vnni", "amx", "auto"])
def test_w8a8_long_rows_sum_exactly(path):
    """The largest products everywhere (x at its row's max, q = 127): past K ~66k VNNI's
    unsigned sum (x + 128) q wraps int32 and the wrap cancels against 128 * sum(q); past
    W8A8_MAX_K (131072) the true sum does not fit int32, VNNI and AMX refuse, and auto runs the
    portable loop, which sums in int64."""
    if path != "auto":
        _skip_unless_here("w8a8", path, torch.float32)
    n = 32
    for k, rows in [(70000, 16), (140000, 1)]:
        q = torch.full((n, k), 127, dtype=torch.int8)
        q[1::2] = -127
        packed = cpu_kernels.pack_int8_weight(q)
        scale, sums = torch.full((n,), 1e-6), q.sum(dim=1, dtype=torch.int32)
        x = torch.full((rows, k), 0.5)
        ref = _reference(x, q, scale, None, w8a8=True)
        if k > 131072 and path != "auto":
            with pytest.raises(RuntimeError, match=f"path '{path}' does not run here"):
                cpu_kernels.int8_linear(x, packed, scale, sums, None, n, k, w8a8=True, path=path)
            continue
        out = cpu_kernels.int8_linear(x, packed, scale, sums, None, n, k, w8a8=True, path=path)
        assert torch.allclose(out, ref, rtol=1e-6, atol=0), (k, (out - ref).abs().max())
