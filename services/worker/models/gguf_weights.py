"""GGUF block-quantized weights kept packed (`--quantization gguf`, the CPU).

Q8_0, Q4_0 and Q4_1 (ggml's blocks of 32 weights of one row with an fp16 scale, and an fp16 min
for Q4_1) are split once, at load, into the arrays kernels/cpu/matmul_gguf.c streams, with the
file's bytes per weight: `qs` (Q8_0: q + 128 as uint8 [N, K]; Q4: each block's 16 nibble bytes
as in the file, [N, K / 2]), `d` and, for Q4_1, `m` (fp16 [N, K / 32]). A weight of another
type (Q4_K, Q6_K, F16, ...) is dequantized to fp32, one tensor at a time, and requantized to
Q8_0: larger than its file, but only these three have a kernel. (K must be a multiple of 32:
gguf_load.py refuses a matrix that is not, naming it.)

How a matmul runs, by the number of rows of x:
- up to `KERNEL_MAX_ROWS`: the quantized kernel (x quantized to 8-bit blocks, integer dot
  products with AVX-512 VNNI, or plain C without it);
- more (prompts): the weight dequantized into a temporary of x's dtype, then the dense matmul,
  when that is faster (see KERNEL_MAX_ROWS for the measurements).
A fused weight (q/k/v, gate/up) whose parts have different types is held as several parts,
each multiplied into its own columns of the output.
"""
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu as cpu_kernels
from services.worker.host_memory import host_empty

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml's type ids
PACKED_TYPES = (Q8_0, Q4_0, Q4_1)
BLOCK = 32
# Bytes of a file block: fp16 d [, fp16 m], then the quants.
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}

# The quantized kernel up to this many rows of x, a dequantized temporary and the dense matmul
# above: where the two took the same time on the default model's shapes (576 x 3072 and
# 1536 x 576, Q4_1; python -m ops.bench.gguf_matmuls, figures in docs/quantization.md). The
# kernel's time grows with the rows (every row is another pass of integer products), the
# temporary's cost is fixed.
KERNEL_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 16}


@dataclass
class GGUFPart:
    """Rows [row0, row0 + rows) of a weight, all of one type, in matmul_gguf.c's layout."""
    qtype: int
    row0: int
    qs: torch.Tensor  # uint8 [rows, K] (Q8_0) or [rows, K / 2] (Q4)
    d: torch.Tensor  # float16 [rows, K / 32]
    m: torch.Tensor | None = None  # float16 [rows, K / 32], Q4_1 only

    @property
    def rows(self) -> int:
        return self.d.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


@dataclass
class GGUFWeight:
    """A weight [out_features, in_features] as packed GGUF parts covering its rows in order."""
    in_features: int
    parts: list[GGUFPart] = field(default_factory=list)

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The whole weight (or its rows `ids`, one part only) in `dtype`, as gguf's own
        dequantize gives it."""
        kernel_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        if ids is not None:
            (part,) = self.parts
            out = cpu_kernels.gguf_dequantize(part.qtype, part.qs, part.d, part.m,
                                              self.in_features, kernel_dtype, ids)
        else:
            outs = [cpu_kernels.gguf_dequantize(p.qtype, p.qs, p.d, p.m, self.in_features,
                                                kernel_dtype) for p in self.parts]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if out.dtype == dtype else out.to(dtype)


def allocate_part(qtype: int, row0: int, rows: int, k: int) -> GGUFPart:
    """An empty part (on huge pages: a step streams it from memory)."""
    nb = k // BLOCK
    qs = host_empty((rows, k if qtype == Q8_0 else k // 2), torch.uint8)
    d = host_empty((rows, nb), torch.float16)
    m = host_empty((rows, nb), torch.float16) if qtype == Q4_1 else None
    return GGUFPart(qtype, row0, qs, d, m)


def fill_from_blocks(part: GGUFPart, start: int, blocks: np.ndarray) -> None:
    """Rows [start, start + len(blocks)) of `part` from a file tensor's raw bytes
    [rows, K / 32 * block bytes] of the part's type: one copy, into place."""
    rows = blocks.shape[0]
    nb = part.d.shape[1]
    raw = blocks.reshape(rows, nb, _BLOCK_BYTES[part.qtype])
    part.d[start:start + rows].numpy().view(np.uint8).reshape(rows, nb, 2)[...] = raw[:, :, 0:2]
    quants = 4 if part.qtype == Q4_1 else 2
    if part.m is not None:
        part.m[start:start + rows].numpy().view(np.uint8).reshape(rows, nb, 2)[...] = raw[:, :, 2:4]
    qs = part.qs[start:start + rows].numpy().reshape(rows, nb, -1)
    qs[...] = raw[:, :, quants:]
    if part.qtype == Q8_0:
        np.bitwise_xor(qs, 0x80, out=qs)  # int8 q -> q + 128


def fill_from_float(part: GGUFPart, start: int, weight: torch.Tensor) -> None:
    """Rows [start, start + len(weight)) of a Q8_0 part quantized from a float weight (the
    block's absmax / 127 as fp16 scale, values rounded against it, as llama.cpp's Q8_0)."""
    assert part.qtype == Q8_0
    rows, k = weight.shape
    if k % BLOCK or part.d.shape[1] != k // BLOCK:
        raise ValueError(f"Q8_0 requantization: a weight of {k} inputs does not fill blocks of "
                         f"{BLOCK} in a part of {part.d.shape[1]} blocks a row")
    w = weight.float().reshape(rows, k // BLOCK, BLOCK)
    d = (w.abs().amax(dim=-1) / 127.0).half()
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int16) + 128
    part.qs[start:start + rows].copy_(q.reshape(rows, k).to(torch.uint8))
    part.d[start:start + rows].copy_(d)


def gguf_linear(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] W^T (+ b) in x's dtype. (Called ~200 times a decode step: kept lean.)"""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.shape[0] > KERNEL_MAX_ROWS.get(x.dtype, -1) or not cpu_kernels.available_for(x):
        out = F.linear(rows, weight.dequantize(x.dtype), bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    parts = weight.parts
    n = parts[-1].row0 + parts[-1].rows
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    if len(parts) == 1:
        part = parts[0]
        cpu_kernels.gguf_matmul(rows, part.qtype, part.qs, part.d, part.m, bias, out)
    else:
        for part in parts:
            end = part.row0 + part.rows
            cpu_kernels.gguf_matmul(rows, part.qtype, part.qs, part.d, part.m,
                                    None if bias is None else bias[part.row0:end],
                                    out[:, part.row0:end])
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def gguf_embedding(input_ids: torch.Tensor, weight: GGUFWeight, dtype: torch.dtype) -> torch.Tensor:
    """The rows `input_ids` of a packed embedding table, dequantized to `dtype`."""
    flat = input_ids.reshape(-1).to(torch.int64)
    out = weight.dequantize(dtype, flat)
    return out.view(*input_ids.shape, weight.in_features)
