"""GGUF block-quantized weights kept packed (`--quantization gguf`, the CPU).

Q8_0, Q4_0 and Q4_1 (ggml's blocks of 32 weights of one row with an fp16 scale, and an fp16 min
for Q4_1) are regrouped once, at load, into the panels pagoda_kernels/cpu/matmul_gguf.c streams (16 rows
interleaved four weights at a time, the last panel padded with zero rows), with the file's bytes
per weight: `qs` (uint8 [panels, K / 32, 512] for Q8_0, q + 128; [panels, K / 32, 256] for Q4,
the file's nibble bytes), `d` and, for Q4_1, `m` (fp16 [panels, K / 32, 16]). Q4_K (super-blocks
of 256 with 6-bit scales and mins per 32) becomes blocks of 32 in Q4_1's form with fp32 `d` and
`m` (d * scale and -dmin * min, exact): 6 bits a weight where its file has 4.5. A weight of
another type (Q5_K, Q6_K, F16, ...) is dequantized to fp32, one tensor at a time, and
requantized to Q8_0: larger than its file, but only these four have a kernel. (K must be a
multiple of 32: gguf_load.py refuses a matrix that is not, naming it.)

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

from pagoda_kernels import cpu as cpu_kernels
from pagoda_kernels.cpu.gguf import PANEL, panel_block_bytes, scale_dtype
from services.worker.host_memory import host_empty

Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12  # ggml's type ids
PACKED_TYPES = (Q8_0, Q4_0, Q4_1, Q4_K)
BLOCK = 32
Q4_K_BLOCK, Q4_K_BYTES = 256, 144  # a Q4_K super-block: its weights, its bytes in the file
# Bytes of a file block: fp16 d [, fp16 m], then the quants.
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}

# The quantized kernel up to this many rows of x, a dequantized temporary and the dense matmul
# above. The kernel's time grows with the rows (each 4 rows are another pass of integer products
# over a panel held in cache), the temporary's cost is mostly fixed; on the default model's
# shapes (576 x 3072 and 1536 x 576, one thread) the kernel at 128 rows took a third of the
# temporary's time in fp32 and two fifths in bf16 (python -m ops.bench.gguf_matmuls, figures in
# docs/quantization.md), with the two lines meeting near 400 rows.
KERNEL_MAX_ROWS = {torch.float32: 256, torch.bfloat16: 256}


@dataclass
class GGUFPart:
    """Rows [row0, row0 + rows) of a weight, all of one type, in matmul_gguf.c's panel layout."""
    qtype: int
    row0: int
    rows: int
    qs: torch.Tensor  # uint8 [panels, K / 32, 512 (Q8_0) or 256 (Q4)]
    d: torch.Tensor  # float16 [panels, K / 32, 16] (float32 for Q4_K)
    m: torch.Tensor | None = None  # the same, Q4_1 and Q4_K only

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
            out = cpu_kernels.gguf_dequantize(part.qtype, part.qs, part.d, part.m, part.rows,
                                              self.in_features, kernel_dtype, ids)
        else:
            outs = [cpu_kernels.gguf_dequantize(p.qtype, p.qs, p.d, p.m, p.rows,
                                                self.in_features, kernel_dtype)
                    for p in self.parts]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if out.dtype == dtype else out.to(dtype)


def allocate_part(qtype: int, row0: int, rows: int, k: int) -> GGUFPart:
    """An empty part (on huge pages: a step streams it from memory); the last panel's padding
    rows are zeros."""
    nb = k // BLOCK
    panels = -(-rows // PANEL)
    scales = scale_dtype(qtype)
    qs = host_empty((panels, nb, panel_block_bytes(qtype)), torch.uint8)
    d = host_empty((panels, nb, PANEL), scales)
    m = host_empty((panels, nb, PANEL), scales) if qtype in (Q4_1, Q4_K) else None
    for t in (qs, d, m):
        if t is not None and panels:
            t[-1].zero_()
    return GGUFPart(qtype, row0, rows, qs, d, m)


def _put_rows(panels: np.ndarray, start: int, values: np.ndarray) -> None:
    """Rows [start, start + len(values)) of a panel array [P, nb, G, 16, W] (a row's values at
    [p, :, :, lane, :]) from values [rows, nb, G, W]: whole panels in one copy, partial ones
    lane by lane."""
    row, end = start, start + len(values)
    while row < end:
        p, lane = divmod(row, PANEL)
        src = values[row - start:]
        if lane == 0 and end - row >= PANEL:
            count = (end - row) // PANEL
            block = src[:count * PANEL].reshape(count, PANEL, *values.shape[1:])
            panels[p:p + count] = block.transpose(0, 2, 3, 1, 4)
            row += count * PANEL
        else:
            take = min(PANEL - lane, end - row)
            panels[p, :, :, lane:lane + take, :] = src[:take].transpose(1, 2, 0, 3)
            row += take


def _put_quants(part: GGUFPart, start: int, quants: np.ndarray) -> None:
    """quants [rows, nb, bytes of a block's row] uint8 (Q8_0: 32 q + 128; Q4: the file's 16
    nibble bytes) into the panels, four bytes a lane."""
    rows, nb = quants.shape[:2]
    view = part.qs.numpy().reshape(part.qs.shape[0], nb, -1, PANEL, 4)
    _put_rows(view, start, quants.reshape(rows, nb, -1, 4))


def _put_scales(target: torch.Tensor, start: int, values: np.ndarray) -> None:
    """Scales [rows, nb] (fp16 as uint16 bits, or fp32) into a [P, nb, 16] scale array."""
    bits = target.numpy()
    if bits.dtype == np.float16:
        bits = bits.view(np.uint16)
    view = bits.reshape(target.shape[0], target.shape[1], 1, PANEL, 1)
    _put_rows(view, start, values.reshape(len(values), -1, 1, 1))


def fill_from_blocks(part: GGUFPart, start: int, blocks: np.ndarray) -> None:
    """Rows [start, start + len(blocks)) of `part` from a file tensor's raw bytes
    [rows, row bytes] of the part's type, regrouped into the panels."""
    if part.qtype == Q4_K:
        _fill_from_q4_k(part, start, blocks)
        return
    rows = blocks.shape[0]
    nb = part.d.shape[1]
    raw = np.ascontiguousarray(blocks).reshape(rows, nb, _BLOCK_BYTES[part.qtype])
    _put_scales(part.d, start, raw[:, :, 0:2].copy().view(np.uint16))
    quants = 4 if part.qtype == Q4_1 else 2
    if part.m is not None:
        _put_scales(part.m, start, raw[:, :, 2:4].copy().view(np.uint16))
    q = raw[:, :, quants:]
    if part.qtype == Q8_0:
        q = np.bitwise_xor(q, 0x80)  # int8 q -> q + 128
    _put_quants(part, start, q)


def _fill_from_q4_k(part: GGUFPart, start: int, blocks: np.ndarray) -> None:
    """Q4_K super-blocks (fp16 d and dmin, 8 six-bit scales and mins packed in 12 bytes, 128
    nibble bytes: 32 bytes per 64 weights, low nibbles the first 32, high the next) as blocks
    of 32 of Q4_1's form: w = (d sc) q + (-dmin m), both fp32 (exact: an fp16 times a 6-bit
    integer), each block's nibbles in Q4_1's byte order."""
    rows = blocks.shape[0]
    raw = np.ascontiguousarray(blocks).reshape(rows, -1, Q4_K_BYTES)
    supers = raw.shape[1]
    d = raw[:, :, 0:2].copy().view(np.float16).astype(np.float32)  # [rows, supers, 1]
    dmin = raw[:, :, 2:4].copy().view(np.float16).astype(np.float32)
    packed = raw[:, :, 4:16].astype(np.uint8)  # the 12 scale bytes
    lo, hi, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (top >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scale = (d * sc.astype(np.float32)).reshape(rows, supers * 8)
    offset = -(dmin * mn.astype(np.float32)).reshape(rows, supers * 8)
    nibbles = raw[:, :, 16:].reshape(rows, supers, 4, 1, 32)
    q = (nibbles >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    q = q.reshape(rows, supers * 8, 32)  # each block of 32's values 0..15, in order
    _put_scales(part.d, start, scale)
    _put_scales(part.m, start, offset)
    _put_quants(part, start, (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8))


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
    _put_quants(part, start, q.to(torch.uint8).numpy())
    _put_scales(part.d, start, d.numpy().view(np.uint16))


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
