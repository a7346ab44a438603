"""RMSNorm, optionally fused with the residual add before it, as a Triton kernel.

x         [T, hidden], each row contiguous, rows at any stride
weight    [hidden], x's dtype
residual  [T, hidden] (optional), each row contiguous: residual += x in place, then the sum
          is normalised (vLLM's fused_add_rms_norm; the residual stream the model carries)
out       [T, hidden] contiguous, a new tensor unless given

The reference is the torch path of services.worker.models.llama.RMSNorm, rounding where it
rounds: `x + residual` is rounded to x's dtype (a bf16 add), and F.rms_norm of that computes
in float32 throughout, x * rsqrt(mean(x * x) + eps) * weight, rounded once at the end (the
F.rms_norm of torch 2.13 multiplies by the weight in float32, before the cast back; the tests
check the kernel against whichever torch runs them).
One program normalises one row, the whole row in registers: BLOCK is hidden rounded up to a
power of two, the lanes past hidden masked to 0 so that they add nothing to the sum of squares.
"""
import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x -> dtype, to nearest even as torch rounds. For bf16 the rounding is spelled
    out on the bits: Triton's interpreter truncates in `x.to(tl.bfloat16)` where a GPU rounds,
    and one code path for both keeps the tests on the CPU meaningful for the GPU (a few integer
    ops, nothing beside the memory traffic of these kernels). NaN -> 0x7FC0, as torch."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # Adding 0x7FFF rounds the low half up past half way; the kept half's lowest bit breaks
        # the tie to even. A carry into the exponent is right (up to infinity at the top).
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits16 = tl.where(x != x, 0x7FC0, bits >> 16).to(tl.uint16)
        return bits16.to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride,
                     out_stride, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + row * residual_stride + cols
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        # The sum in float32, rounded to the stream's dtype, as torch's bf16 add; the rounded
        # sum is both the new residual and what is normalised.
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    # float32 mean of squares (the reference's reduction order differs: the last bit of the
    # variance may too), then (x * rstd) * weight in float32 and one rounding at the store.
    # rsqrt is 1 / sqrt in the interpreter, as torch computes it on the CPU; on a GPU it is one
    # approximate instruction, like torch's rsqrtf there. (A GPU compiler may also fuse the
    # squares into the sum's adds: exact anyway for bf16 and fp16 values, one rounding fewer
    # for float32.)
    variance = tl.sum(xf * xf, axis=0) / HIDDEN
    rstd = tl.math.rsqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd) * w
    tl.store(out_ptr + row * out_stride + cols, round_to(y, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None):
    """RMSNorm(x) -> out [T, hidden]. With `residual`: residual += x in place (rounded to its
    dtype) and -> (RMSNorm(residual), residual), as the model's RMSNorm returns. `out` (contiguous
    [T, hidden], x's dtype) is written instead of a new tensor where given."""
    if x.dim() != 2:
        raise ValueError(f"rms_norm: x must be [T, hidden], got {tuple(x.shape)}")
    tokens, hidden = x.shape
    if x.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x is {x.dtype}, supported: {', '.join(map(str, _DTYPES))}")
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight must be [{hidden}] {x.dtype}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if hidden > 1 and x.stride(1) != 1:
        raise ValueError(f"rms_norm: x's rows must be contiguous, got strides {x.stride()}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"rms_norm: residual must be {tuple(x.shape)} {x.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if hidden > 1 and residual.stride(1) != 1:
            raise ValueError(f"rms_norm: residual's rows must be contiguous, got strides "
                             f"{residual.stride()}")
    if out is None:
        out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"rms_norm: out must be contiguous {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    weight = weight.contiguous()
    devices = {t.device for t in (x, weight, out) + (() if residual is None else (residual,))}
    if len(devices) != 1:
        raise ValueError(f"rms_norm: tensors on several devices {sorted(map(str, devices))}")
    if tokens > 0:
        block = triton.next_power_of_2(hidden)
        # Enough warps that each thread holds a few values of the row, not hundreds.
        num_warps = min(max(block // 512, 1), 16)
        _rms_norm_kernel[(tokens,)](
            x, x if residual is None else residual, weight, out, x.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0), eps,
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=num_warps)
    return out if residual is None else (out, residual)
