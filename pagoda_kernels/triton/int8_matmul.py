"""int8 weight matmuls for the CUDA path (`--quantization int8` and `w8a8`) as Triton kernels.

x      [M, K] bf16, fp16 or fp32, each row contiguous, rows at any stride
q      [N, K] int8, contiguous: the rows of services.worker.models.int8.quantize_rows, used as
       they come (no repacking: the kernels read q^T tiles straight from the rows)
s      [N] fp32, one scale per output channel: w ~ q * s[:, None]
bias   [N] (optional), x's dtype
out    [M, N] contiguous, x's dtype, a new tensor unless given

- `int8_linear` (weight-only): y = x (q * s[:, None])^T + bias. Each int8 tile is converted to
  x's dtype (exact: every int8 is a bf16 / fp16 value) and multiplied by tl.dot with a float32
  accumulator (fp32 x, and bf16 under the interpreter, `_interpreted_bf16`: both operands in
  float32 with full-precision "ieee" products, as torch's fp32 matmul on CUDA without TF32); the accumulator is scaled by s per column at the end, the bias added in float32, and
  the sum rounded once to x's dtype (to nearest even, `round_to`).
- `w8a8_linear`: x is quantized per row first (`quantize_rows_int8`: scale max|x_row| / 127,
  1 for a zero row, q = x / scale rounded half to even and clamped to +-127, as quantize_rows),
  then an int8 x int8 tl.dot sums in int32 (exact), and y = (acc * x_scale[:, None]) * s[None, :]
  + bias in float32, rounded once to x's dtype.
The reference, services.worker.models.int8.int8_linear's torch path, rounds the product to x's
dtype before adding the bias (two roundings where the kernels round once) and, weight-only,
multiplies by the dequantized weight q * s rounded to x's dtype; the tests compare both with the
float64 product of the dequantized weight, within tolerances that say so.
K and N need not be multiples of the blocks (masked loads add zeros); M may be 1 (decode).
"""
import os

import torch
import triton
import triton.language as tl

from pagoda_kernels.triton.norm import round_to

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DECODE_MIN_PROGRAMS = 256  # see _blocks
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: v + it - it rounds v (|v| < 2^22) half to even


def _interpreted_bf16(x: torch.Tensor) -> bool:
    """bf16 x under Triton's interpreter, whose tl.dot multiplies bf16 operands as the raw
    uint16 it stores them in (and whose int8 -> bf16 conversion is wrong too): there the
    operands go to tl.dot as float32 instead. The same products (a bf16 times an int8 is exact
    in float32, as in the GPU's bf16 MMA) and a float32 sum; only the order of the sum may
    differ from the GPU's."""
    return x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _weight_only_kernel(x_ptr, q_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, x_stride, out_stride,
                        HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # q^T tile [BLOCK_K, BLOCK_N] from the rows of q; int8 -> x's dtype is exact.
        w = tl.load(q_ptr + cols[None, :] * K + k[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0)
        if FP32_DOT:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    s = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    y = acc * s[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             round_to(y, out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, x_stride, BLOCK: tl.constexpr):
    """One program per row: scale = max|x| / 127 (1 for a zero row), q = rint(x / scale)
    clamped to +-127, both divisions correctly rounded (div_rn) as torch's."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + ks
        x = tl.load(x_ptr + row * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.max(amax, axis=0), 127.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + ks
        x = tl.load(x_ptr + row * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, scale)  # |v| <= 127 (+ rounding): the magic add is exact there
        v = (v + _ROUND_MAGIC) - _ROUND_MAGIC
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        tl.store(q_ptr + row * K + k, v.to(tl.int8), mask=k < K)


@triton.jit
def _w8a8_kernel(xq_ptr, xs_ptr, q_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, out_stride,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        xq = tl.load(xq_ptr + rows[:, None] * K + k[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(q_ptr + cols[None, :] * K + k[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc = tl.dot(xq, w, acc, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
    s = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    y = (acc.to(tl.float32) * xs[:, None]) * s[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             round_to(y, out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _blocks(m: int, n: int, int8_dot: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the rows: decode streams the weight (a thin M
    tile, and columns per program narrowed until there are at least 256 programs, so that a
    4096-wide output still spreads over every SM of a large GPU: a guess no GPU has timed
    yet, ops/bench/gpu_check times it); prompts use square tiles. 16 is the smallest tl.dot
    tile side."""
    if m <= 16:
        bn = next((b for b in (64, 32) if triton.cdiv(n, b) >= _DECODE_MIN_PROGRAMS), 16)
        # Narrower tiles go deeper in K, so that each step still loads as many weight bytes.
        return 16, bn, (128 if int8_dot else 64) * (64 // bn), 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 128, 64, 8


def _check(name: str, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{name}: x must be [M, K] of {', '.join(map(str, _DTYPES))}, got "
                         f"{tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if k > 1 and x.stride(1) != 1:
        raise ValueError(f"{name}: x's rows must be contiguous, got strides {x.stride()}")
    if q.dim() != 2 or q.shape[1] != k or q.dtype != torch.int8 or not q.is_contiguous():
        raise ValueError(f"{name}: q must be contiguous [N, {k}] int8, got {tuple(q.shape)} "
                         f"{q.dtype}")
    n = q.shape[0]
    if s.shape != (n,) or s.dtype != torch.float32:
        raise ValueError(f"{name}: s must be [{n}] float32, got {tuple(s.shape)} {s.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias must be [{n}] {x.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous ({m}, {n}) {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    tensors = (x, q, s, out) + (() if bias is None else (bias,))
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on several devices {sorted(map(str, devices))}")
    return out


def int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Weight-only: x [M, K] (q * s[:, None])^T (+ bias) -> out [M, N] in x's dtype."""
    out = _check("int8_linear", x, q, s, bias, out)
    m, k = x.shape
    n = q.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else out.zero_())
    bm, bn, bk, warps = _blocks(m, n, int8_dot=False)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _weight_only_kernel[grid](
        x, q, s, x if bias is None else bias, out, m, n, k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, FP32_DOT=x.dtype == torch.float32 or _interpreted_bf16(x),
        BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps)
    return out


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] int8, scale [M] fp32), as services.worker.models.int8.quantize_rows
    computes them."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m > 0:
        block = min(triton.next_power_of_2(max(k, 1)), 4096)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK=block,
                                    num_warps=min(max(block // 512, 1), 8))
    return q, scale


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [M, K] quantized per row, then (xq qi^T) * x_scale * s (+ bias) -> out [M, N] in x's
    dtype."""
    out = _check("w8a8_linear", x, q, s, bias, out)
    m, k = x.shape
    n = q.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else out.zero_())
    xq, xs = quantize_rows_int8(x)
    bm, bn, bk, warps = _blocks(m, n, int8_dot=True)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _w8a8_kernel[grid](
        xq, xs, q, s, x if bias is None else bias, out, m, n, k, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out
