"""What the Triton attention kernels (paged_attention.py, prefill_attention.py) share: reading
K/V tiles in place from the paged cache (8-bit caches converted per tile), the fp32 dot for
bf16 under the interpreter, and the checks of their arguments.
"""
import os

import torch
import triton
import triton.language as tl

from pagoda_kernels import reference

# Scores are kept in log2 units so the kernels can use exp2: exp(x) == exp2(x * log2(e)).
LOG2_E = 1.4426950408889634

# triton.jit reads TRITON_INTERPRET when it decorates a kernel, i.e. when this module is
# imported: with it set, the kernels run on CPU tensors through the interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The kernels' CACHE_FORMAT: 0 for a cache in the query's dtype, else an 8-bit one read as bytes.
CACHE_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@triton.jit
def kv_tile_offsets(block_table_row_ptr, token_pos, token_valid, block_size: tl.constexpr,
                    stride_cache_block, stride_cache_token):
    """Offsets into a KV cache of the tokens at positions `token_pos` (a vector) of one
    sequence, whose block table row starts at `block_table_row_ptr`. Masked-off tokens map to
    block 0 (never used: their loads are masked too)."""
    logical_block = token_pos // block_size
    block_id = tl.load(block_table_row_ptr + logical_block, mask=token_valid, other=0)
    # int64: block_id * stride overflows int32 on caches over 2 GiB elements.
    return (block_id.to(tl.int64) * stride_cache_block
            + (token_pos % block_size).to(tl.int64) * stride_cache_token)


@triton.jit
def dequantize_tile(x, CACHE_FORMAT: tl.constexpr):
    """uint8 cache bytes -> float32 values: int8 (before its rows' scales), or fp8 e4m3 / e5m2
    by integer arithmetic (as pagoda_kernels/cpu/kv_quant.h), which every GPU and the interpreter
    run. The cache never holds fp8 NaN or inf codes (writes saturate)."""
    if CACHE_FORMAT == 1:
        return x.to(tl.int8, bitcast=True).to(tl.float32)
    em = (x & 0x7F).to(tl.uint32)  # exponent and mantissa
    if CACHE_FORMAT == 2:  # e4m3: bias 7, 3 mantissa bits; codes below 8 subnormal
        normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        mag = tl.where(em < 8, em.to(tl.float32) * 0.001953125, normal)
    else:  # e5m2: bias 15, 2 mantissa bits; codes below 4 subnormal
        normal = ((em << 21) + (112 << 23)).to(tl.float32, bitcast=True)
        mag = tl.where(em < 4, em.to(tl.float32) * 0.0000152587890625, normal)
    return tl.where((x & 0x80) != 0, -mag, mag)


@triton.jit
def int8_row_scales(cache_ptr, row_offsets, row_valid, HEAD_DIM: tl.constexpr):
    """The float32 scales after the int8 cache rows at byte offsets `row_offsets`, put together
    from their 4 little-endian bytes (the rows' addresses are not 4-aligned in general)."""
    base = cache_ptr + row_offsets + HEAD_DIM
    bits = tl.load(base, mask=row_valid, other=0).to(tl.uint32)
    bits |= tl.load(base + 1, mask=row_valid, other=0).to(tl.uint32) << 8
    bits |= tl.load(base + 2, mask=row_valid, other=0).to(tl.uint32) << 16
    bits |= tl.load(base + 3, mask=row_valid, other=0).to(tl.uint32) << 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_k_tile(cache_ptr, token_offsets, token_valid, dims, dtype: tl.constexpr,
                HEAD_DIM: tl.constexpr, CACHE_FORMAT: tl.constexpr):
    """K of the tokens at `token_offsets`, transposed: [HEAD_DIM, tokens] in `dtype`."""
    k = tl.load(cache_ptr + token_offsets[None, :] + dims[:, None], mask=token_valid[None, :],
                other=0)
    if CACHE_FORMAT != 0:
        k = dequantize_tile(k, CACHE_FORMAT)
        if CACHE_FORMAT == 1:
            k = k * int8_row_scales(cache_ptr, token_offsets, token_valid, HEAD_DIM)[None, :]
        k = k.to(dtype)
    return k


@triton.jit
def load_v_tile(cache_ptr, token_offsets, token_valid, dims, dtype: tl.constexpr,
                HEAD_DIM: tl.constexpr, CACHE_FORMAT: tl.constexpr):
    """V of the tokens at `token_offsets`: [tokens, HEAD_DIM] in `dtype`."""
    v = tl.load(cache_ptr + token_offsets[:, None] + dims[None, :], mask=token_valid[:, None],
                other=0)
    if CACHE_FORMAT != 0:
        v = dequantize_tile(v, CACHE_FORMAT)
        if CACHE_FORMAT == 1:
            v = v * int8_row_scales(cache_ptr, token_offsets, token_valid, HEAD_DIM)[:, None]
        v = v.to(dtype)
    return v


@triton.jit
def dot_fp32(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32: fp32 inputs multiplied exactly ("ieee", not tf32), bf16/fp16
    ones on the tensor cores. UPCAST multiplies in fp32 instead: Triton's interpreter (CPU
    tensors) runs tl.dot on bf16's raw uint16 bits, so the wrappers set it there; the inputs are
    already rounded to their dtype, so the products are the same."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        result = tl.dot(a, b, input_precision="ieee")
    else:
        result = tl.dot(a, b)
    return result


def needs_upcast_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels must multiply in fp32 (see dot_fp32): bf16 under the interpreter."""
    return dtype == torch.bfloat16 and device.type == "cpu"


def check_runnable(tensor: torch.Tensor) -> None:
    """Triton runs CUDA tensors, and CPU tensors only under its interpreter."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and INTERPRETED:
        return
    raise ValueError(f"the Triton attention kernels need CUDA tensors (or CPU tensors with "
                     f"TRITON_INTERPRET=1 set before triton is imported), got {tensor.device}")


def check_kv_cache(query: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Checks the query and caches shared by both kernels -> (num_heads, num_kv_heads,
    head_dim, block_size)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got shape "
                         f"{tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, _ = key_cache.shape
    cache_head_dim = reference.cache_head_dim(key_cache)
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype {query.dtype} is unsupported (float32, float16, bfloat16)")
    if value_cache.dtype != key_cache.dtype or (key_cache.dtype != query.dtype
                                                and key_cache.dtype not in CACHE_FORMATS):
        raise ValueError(f"query, key_cache and value_cache must share a dtype (or the caches "
                         f"one 8-bit dtype), got {query.dtype}, {key_cache.dtype}, "
                         f"{value_cache.dtype}")
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if not is_power_of_two(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if not is_power_of_two(block_size):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), got strides "
                             f"{t.stride()}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    check_runnable(query)
    return num_heads, num_kv_heads, head_dim, block_size


def cache_bytes(key_cache: torch.Tensor, value_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What the kernels are passed for a cache: the caches themselves (CACHE_FORMAT 0), or an
    8-bit cache's bytes (uint8 views, their strides in bytes) and its CACHE_FORMAT."""
    cache_format = CACHE_FORMATS.get(key_cache.dtype, 0)
    if cache_format:
        return key_cache.view(torch.uint8), value_cache.view(torch.uint8), cache_format
    return key_cache, value_cache, 0


def check_index(name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    if t.dim() != dims or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a {dims}-d int32/int64 tensor, got {t.dtype} of shape "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, query on {device}")
    if t.stride(-1) != 1 and t.numel() > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The output buffer: `out` after checking it, else a new one like the query."""
    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {query.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in head_dim (stride 1)")
    return out
