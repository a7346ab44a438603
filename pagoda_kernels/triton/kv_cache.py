"""The KV cache write (vLLM's reshape_and_cache) as a Triton kernel.

key / value    [T, num_kv_heads, head_dim], each token's heads contiguous, tokens at any stride
               (so the k and v slices of a fused qkv projection are written without a copy)
key_cache /    [num_blocks, block_size, num_kv_heads, head_dim], contiguous
value_cache
slot_mapping   [T] int64, slot = block_id * block_size + offset; -1 marks a padding token

Token t's key and value rows go to cache slot slot_mapping[t]. The reference is
pagoda_kernels.reference.write_kv_cache (an index_copy_ into the caches seen as
[num_blocks * block_size, num_kv_heads, head_dim]); the result is the same, bit for bit, since
nothing is computed, only copied. Unlike the reference, a slot of -1 is allowed and writes
nothing: a batch padded to a fixed size (a captured graph's) points its padding tokens there.

Into an 8-bit cache (int8, float8_e4m3fn, float8_e5m2; layouts in pagoda_kernels/reference.py) each
(token, KV head) row is quantized as pagoda_kernels.reference.quantize_kv quantizes it, in integer
arithmetic on the float32 bits (as pagoda_kernels/cpu/kv_quant.h): round to nearest even, fp8
saturated to its largest finite value; int8 rows get their float32 scale in their last 4 bytes.
"""
import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _write_kv_cache_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                           key_stride, value_stride, num_slots, ROW: tl.constexpr,
                           BLOCK: tl.constexpr):
    # One program per (token, BLOCK values of its row of num_kv_heads * head_dim values): the
    # row is contiguous in the input and in the cache slot, so this is one masked copy.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + token)
    # Padding (-1) writes nothing. Slots past the cache are dropped as well rather than written
    # out of bounds: the kernel cannot raise, and checking on the host would wait on the device.
    # (One comparison against a row length of 0 or ROW, rather than `&` of the scalar test
    # into the lane mask, which Triton's interpreter turns into an int32 mask it cannot use.)
    mask = cols < tl.where((slot >= 0) & (slot < num_slots), ROW, 0)
    dst = slot * ROW + cols  # int64: a large cache holds more than 2**31 values
    k = tl.load(key_ptr + token * key_stride + cols, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + token * value_stride + cols, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


# The 8-bit caches, as _write_kv_cache_q8_kernel's CACHE_FORMAT.
_CACHE_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + _ROUND) - _ROUND rounds |x| < 2**22 to nearest even


@triton.jit
def _fp8_bits(x, MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
              LEAST_NORMAL: tl.constexpr, SUB_STEPS: tl.constexpr):
    """float32 x -> fp8 codes (uint32) with MANTISSA bits and exponent BIAS, saturated to MAX.
    Below LEAST_NORMAL (2^(1 - BIAS)) codes count steps of 1 / SUB_STEPS
    (2^(1 - BIAS - MANTISSA))."""
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), MAX)
    SHIFT: tl.constexpr = 23 - MANTISSA
    bits = a.to(tl.uint32, bitcast=True)
    bits = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)  # ties to even
    normal = (bits >> SHIFT) - ((127 - BIAS) << MANTISSA)
    sub = ((a * SUB_STEPS + _ROUND) - _ROUND).to(tl.uint32)
    return tl.where(a < LEAST_NORMAL, sub, normal) | sign


@triton.jit
def _write_kv_cache_q8_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                              key_stride, value_stride, num_slots, num_kv_heads,
                              HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                              ROW_BYTES: tl.constexpr, CACHE_FORMAT: tl.constexpr):
    # One program per (token, KV head): one cache row each of K and V.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_PAD)
    slot = tl.load(slot_ptr + token)
    mask = dims < tl.where((slot >= 0) & (slot < num_slots), HEAD_DIM, 0)
    dst = (slot * num_kv_heads + head) * ROW_BYTES
    for kv in tl.static_range(2):
        if kv == 0:
            x = tl.load(key_ptr + token * key_stride + head * HEAD_DIM + dims, mask=mask, other=0)
            cache_ptr = key_cache_ptr
        else:
            x = tl.load(value_ptr + token * value_stride + head * HEAD_DIM + dims, mask=mask,
                        other=0)
            cache_ptr = value_cache_ptr
        x = x.to(tl.float32)
        if CACHE_FORMAT == 1:
            scale = tl.max(tl.abs(x), axis=0) / 127.0
            q = x / tl.where(scale > 0, scale, 1.0)  # a row of zeros: codes 0, scale 0
            q = tl.minimum(tl.maximum((q + _ROUND) - _ROUND, -127.0), 127.0)
            codes = q.to(tl.int32).to(tl.uint32) & 0xFF
            # The scale's 4 bytes, little-endian, after the values.
            byte = tl.arange(0, 4)
            scale_bytes = (scale.to(tl.uint32, bitcast=True) >> (byte * 8)) & 0xFF
            scale_mask = byte < tl.where((slot >= 0) & (slot < num_slots), 4, 0)
            tl.store(cache_ptr + dst + HEAD_DIM + byte, scale_bytes.to(tl.uint8),
                     mask=scale_mask)
        elif CACHE_FORMAT == 2:
            codes = _fp8_bits(x, 448.0, 3, 7, 0.015625, 512.0)
        else:
            codes = _fp8_bits(x, 57344.0, 2, 15, 0.00006103515625, 65536.0)
        tl.store(cache_ptr + dst + dims, codes.to(tl.uint8), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As pagoda_kernels.reference.write_kv_cache: key/value [T, num_kv_heads, head_dim] (each token's
    heads contiguous, tokens at any stride) -> the cache slots `slot_mapping` [T] int64, in
    place. A slot of -1 (padding) is skipped; so is one >= num_blocks * block_size, unchecked."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"kv cache write: key and value must both be [T, num_kv_heads, "
                         f"head_dim], got {tuple(key.shape)} and {tuple(value.shape)}")
    tokens, num_kv_heads, head_dim = key.shape
    cache_format = _CACHE_FORMATS.get(key_cache.dtype, 0)
    row_width = head_dim + 4 if key_cache.dtype == torch.int8 else head_dim
    if (key_cache.dim() != 4 or value_cache.shape != key_cache.shape
            or key_cache.shape[2:] != (num_kv_heads, row_width)):
        raise ValueError(f"kv cache write: caches must both be [num_blocks, block_size, "
                         f"{num_kv_heads}, {head_dim}], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    if not (key.dtype == value.dtype and key.dtype in _DTYPES
            and value_cache.dtype == key_cache.dtype
            and (key_cache.dtype == key.dtype or cache_format)):
        raise ValueError(f"kv cache write: {key.dtype} / {value.dtype} rows into "
                         f"{key_cache.dtype} / {value_cache.dtype} caches (one dtype of "
                         f"{', '.join(map(str, _DTYPES))} for all four, or 8-bit caches)")
    for name, t in (("key", key), ("value", value)):
        # The kernel copies each token's row as one run of num_kv_heads * head_dim values (the
        # stride of a dimension of size 1 does not matter).
        if ((head_dim > 1 and t.stride(2) != 1)
                or (num_kv_heads > 1 and t.stride(1) != head_dim)):
            raise ValueError(f"kv cache write: {name} rows must have each token's heads "
                             f"contiguous, got strides {t.stride()} for {tuple(t.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("kv cache write: the caches must be contiguous")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (tokens,):
        raise ValueError(f"kv cache write: slot_mapping must be int64 [{tokens}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"kv cache write: tensors on several devices {sorted(map(str, devices))}")
    if tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if cache_format:
        _write_kv_cache_q8_kernel[(tokens, num_kv_heads)](
            key, value, key_cache.view(torch.uint8), value_cache.view(torch.uint8), slot_mapping,
            key.stride(0), value.stride(0), num_slots, num_kv_heads, HEAD_DIM=head_dim,
            HEAD_PAD=triton.next_power_of_2(head_dim), ROW_BYTES=row_width,
            CACHE_FORMAT=cache_format, num_warps=1)
        return
    row = num_kv_heads * head_dim
    block = min(triton.next_power_of_2(row), 1024)
    grid = (tokens, triton.cdiv(row, block))
    _write_kv_cache_kernel[grid](key, value, key_cache, value_cache, slot_mapping,
                                 key.stride(0), value.stride(0),
                                 key_cache.shape[0] * key_cache.shape[1], ROW=row, BLOCK=block,
                                 num_warps=4 if block >= 512 else 1)
