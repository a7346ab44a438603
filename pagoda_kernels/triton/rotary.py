"""The rotary embedding (Hugging Face / GPT-NeoX "rotate_half" layout) as a Triton kernel, in
place on the fused q|k projection.

x          [T, heads, head_dim]: q's heads then k's (num_heads + num_kv_heads of them), each
           token's heads contiguous, tokens at any stride (a view of the fused qkv output, whose
           v columns are left alone)
positions  [T] int64, each in [0, max_positions)
cos_sin    [max_positions, 2, head_dim] contiguous, x's dtype: rows [cos, cos] and [-sin, sin],
           as services.worker.models.llama.RotaryEmbedding builds it (its `cos_sin` buffer)

The reference is the torch path of RotaryEmbedding.forward:
    torch.addcmul(x * cos, x.roll(head_dim // 2, dims=-1), sin)
that is, with x = [x1, x2] and the table's rows c = [c1, c2], s = [s1, s2]:
    [x1 * c1 + x2 * s1, x2 * c2 + x1 * s2]
Its rounding is copied: `x * cos` is a product rounded to x's dtype, and addcmul adds the
product of the other two to it as one float32 fused multiply-add, the sum rounded once to x's
dtype (torch's CPU addcmul rounds once in float32 too; its CUDA kernel gets the fma from nvcc's
default contraction). In bf16 the product of two bf16 values is exact in float32, so there a
separate multiply and add would give the same; in float32 they would not. The compiled CPU
kernel (pagoda_kernels.cpu.rotary_) rounds as Hugging Face does instead, both products to bf16 before
the add, and may differ from this by one bf16 step.
"""
import torch
import triton
import triton.language as tl

from pagoda_kernels.triton.norm import round_to

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_sin_ptr, x_stride, max_positions,
                   HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    # One program per (token, BLOCK_H of its heads), the tile [BLOCK_H, head_dim // 2]: each
    # lane rotates the pair (d, d + half), which it both reads and writes, so in place is safe.
    token = tl.program_id(0).to(tl.int64)
    half = HEAD_DIM // 2
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    pos = tl.load(positions_ptr + token)
    # A position outside the table leaves its token as it was (the kernel cannot raise; reading
    # past the table would be worse).
    # (A comparison with 0 or half, not `&` of the scalar into the lanes' mask, which Triton's
    # interpreter makes an int32 mask it cannot use.)
    d_mask = d < tl.where((pos >= 0) & (pos < max_positions), half, 0)
    table = cos_sin_ptr + pos * (2 * HEAD_DIM)
    c1 = tl.load(table + d, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(table + half + d, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(table + HEAD_DIM + d, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(table + HEAD_DIM + half + d, mask=d_mask, other=0.0).to(tl.float32)
    mask = (heads[:, None] < HEADS) & d_mask[None, :]
    ptrs1 = x_ptr + token * x_stride + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(ptrs1, mask=mask, other=0.0)
    x2 = tl.load(ptrs1 + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # x * cos rounded to x's dtype (a no-op in float32), then + roll(x) * sin as one fused
    # multiply-add in float32, which is what torch's addcmul computes (on the CPU and on CUDA).
    a1 = round_to(x1 * c1[None, :], dtype).to(tl.float32)
    a2 = round_to(x2 * c2[None, :], dtype).to(tl.float32)
    out1 = tl.fma(x2, s1[None, :], a1)
    out2 = tl.fma(x1, s2[None, :], a2)
    tl.store(ptrs1, round_to(out1, dtype), mask=mask)
    tl.store(ptrs1 + half, round_to(out2, dtype), mask=mask)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] in place (each token's heads contiguous, tokens at any
    stride) at `positions` [T] int64 with the table cos_sin [max_positions, 2, head_dim];
    returns x. As pagoda_kernels.cpu.rotary_, but a position outside the table is not checked (no
    host sync): that token is left unrotated."""
    if x.dim() != 3:
        raise ValueError(f"rotary: x must be [T, heads, head_dim], got {tuple(x.shape)}")
    tokens, heads, head_dim = x.shape
    if x.dtype not in _DTYPES:
        raise ValueError(f"rotary: x is {x.dtype}, supported: {', '.join(map(str, _DTYPES))}")
    if head_dim % 2:
        raise ValueError(f"rotary: head_dim must be even, got {head_dim}")
    if x.stride(2) != 1 or (heads > 1 and x.stride(1) != head_dim):
        raise ValueError(f"rotary: each token's heads must be contiguous, got strides "
                         f"{x.stride()} for {tuple(x.shape)}")
    if cos_sin.dim() != 3 or cos_sin.shape[1:] != (2, head_dim) or cos_sin.dtype != x.dtype:
        raise ValueError(f"rotary: cos_sin must be [max_positions, 2, {head_dim}] {x.dtype}, "
                         f"got {tuple(cos_sin.shape)} {cos_sin.dtype}")
    if not cos_sin.is_contiguous():
        raise ValueError("rotary: cos_sin must be contiguous")
    if positions.dtype != torch.int64 or positions.shape != (tokens,):
        raise ValueError(f"rotary: positions must be int64 [{tokens}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    devices = {t.device for t in (x, positions, cos_sin)}
    if len(devices) != 1:
        raise ValueError(f"rotary: tensors on several devices {sorted(map(str, devices))}")
    if tokens == 0 or heads == 0:
        return x
    positions = positions.contiguous()
    block_d = triton.next_power_of_2(head_dim // 2)
    # About 2048 pairs a program: all of a small model's heads, a slice of a large one's.
    block_h = min(triton.next_power_of_2(heads), max(2048 // block_d, 1))
    grid = (tokens, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](x, positions, cos_sin, x.stride(0), cos_sin.shape[0], HEADS=heads,
                         HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
                         num_warps=4 if block_h * block_d >= 1024 else 2)
    return x
