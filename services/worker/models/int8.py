"""int8 matmul weights for the CPU: `--quantization int8` (weight-only) and `--quantization w8a8`.

Each weight [out, in] is kept as int8 `q` with one fp32 scale per output row,
`s = max|w_row| / 127` (symmetric, no zero point), so that w ~ q * s[:, None]; only q (a
quarter of fp32, half of bf16) and s stay in memory.
- int8: activations keep their dtype (under 16 rows on VNNI they go in as 24-bit fixed point
  per row, a power-of-two step s = 2^(e - 23) for the row's largest in [2^(e-1), 2^e): bf16
  values of at least 2^-15 of the row's largest exactly, anything else rounded to a multiple of
  s, at most 2^-23 of the largest off).
- w8a8: each row of activations is quantized to int8 too (its own scale, max|x| / 127, at every
  call), the products are summed in int32, and the output is acc * x_scale * w_scale.
The kernels are pagoda_kernels/cpu/matmul_int8.c: q is packed into its panels at load, and a gate/up
weight gets SiLU(gate) * up in the kernel's epilogue. Without the C kernels (no compiler,
PAGODA_CPU_KERNELS=0) q stays in rows and torch multiplies: a dequantized temporary
(weight-only) or `torch._int_mm` (w8a8), SiLU * up after it. A bias is added in the activation
dtype.
On CUDA the same q [out, in] rows and scales stay on the device and pagoda_kernels/triton/int8_matmul.py
multiplies them (`triton_int8_linear`; SiLU * up after it, in the model).
"""
import importlib.util

import torch
import torch.nn.functional as F

from pagoda_kernels import cpu as cpu_kernels
from services.worker.host_memory import host_copy, host_empty

QUANTIZATIONS = ("int8", "w8a8")
# The PackedWeight kinds of the Triton kernels: q [out, in] int8 rows and scales on the device.
TRITON_QUANTIZATIONS = ("triton_int8", "triton_w8a8")

# int8 / w8a8 weights for the Triton kernels: None = for CUDA weights when triton is installed;
# True forces them for any weight (CPU tensors need TRITON_INTERPRET=1: the tests), False never.
TRITON_INT8: bool | None = None
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_int8_for(weight: torch.Tensor) -> bool:
    return (weight.is_cuda and _HAS_TRITON) if TRITON_INT8 is None else TRITON_INT8


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] (or w8a8's activations [rows, in]) -> (q [out, in] int8, s [out]
    fp32): s = max|row| / 127 (1 for a zero row), q = round(w / s) in [-127, 127]."""
    w = weight.detach().float()  # one tensor at a time: the only fp32 copy made
    scale = w.abs().amax(dim=1) / 127.0
    # An all-zero row: any scale gives q = 0; 1 avoids 0 / 0.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def quantize_weight(weight: torch.Tensor, gate_up: bool, w8a8: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """A CPU weight [out, in] -> (data, scale fp32 [out], weight sums int32 [out] (the VNNI
    paths need them), whether SiLU(gate) * up is fused). data is the kernel's panel layout (1-d),
    or q [out, in] itself where the kernels do not run."""
    del w8a8  # the same weights serve both modes
    q, scale = quantize_rows(weight)
    sums = q.sum(dim=1, dtype=torch.int32)
    if not cpu_kernels.int8_kernels_available():
        return host_copy(q), scale, sums, False
    fused = gate_up and q.shape[0] % 2 == 0
    # On huge pages, like the other packed weights: a step streams it from memory.
    return cpu_kernels.pack_int8_weight(q, fused, empty=host_empty), scale, sums, fused


def int8_rows(data: torch.Tensor, out_features: int, in_features: int,
              gate_up: bool) -> torch.Tensor:
    """q [out, in] int8 of a `quantize_weight` result (for references and tests)."""
    if data.dim() == 2:
        return data
    return cpu_kernels.unpack_int8_weight(data, out_features, in_features, gate_up)


def int8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                weight_sums: torch.Tensor | None, bias: torch.Tensor | None, out_features: int,
                in_features: int, gate_up: bool, w8a8: bool) -> torch.Tensor:
    """x [..., in] (q * s[:, None])^T (+ b) in x's dtype (w8a8: x quantized per row first);
    SiLU(gate) * up of that for a fused `gate_up` weight."""
    if data.dim() == 1 and x.dtype in (torch.bfloat16, torch.float32):
        return cpu_kernels.int8_linear(x, data, scale, weight_sums, bias, out_features,
                                       in_features, gate_up, w8a8)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    q = int8_rows(data, out_features, in_features, gate_up)
    if w8a8:
        xq, xs = quantize_rows(x2)
        out = (torch._int_mm(xq, q.t()).float() * xs[:, None] * scale).to(x.dtype)
    else:
        out = x2 @ (q.to(x.dtype) * scale.to(x.dtype)[:, None]).t()
    if bias is not None:
        out += bias
    if gate_up:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out.view(*lead, out.shape[-1])


def triton_int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None, w8a8: bool) -> torch.Tensor:
    """x [..., in] (q * s[:, None])^T (+ b) in x's dtype by the Triton kernels (w8a8: x
    quantized per row first)."""
    from pagoda_kernels.triton import int8_matmul  # needs triton: imported where it runs
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    fn = int8_matmul.w8a8_linear if w8a8 else int8_matmul.int8_linear
    out = fn(x2, q, scale, bias)
    return out.view(*lead, out.shape[-1])
