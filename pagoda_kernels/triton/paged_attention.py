"""Paged decode attention in Triton: one query token per sequence against its cached K/V.

Computes exactly what `pagoda_kernels.reference.paged_decode_attention` computes (the reference these
kernels are tested against): sequence s's query, [num_heads, head_dim], attends to the first
seq_lens[s] tokens of its paged cache, with grouped-query attention (query head h reads KV head
h // (num_heads // num_kv_heads)). Layouts, as in the reference:
  query                    [num_seqs, num_heads, head_dim]
  key_cache / value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables             [num_seqs, max_blocks] int32/int64, padded with block 0
  seq_lens                 [num_seqs] int32/int64, >= 1
  out                      [num_seqs, num_heads, head_dim], the query's dtype
The cache may also be 8-bit (int8, float8_e4m3fn, float8_e5m2; pagoda_kernels/reference.py has the
layouts): the kernels read its bytes and convert each tile to the query's dtype (int8 times its
rows' scales), as the reference's dequantize_kv does.

How the work is split (flash-decoding):
  * The attention kernel's grid is (num_seqs, num_kv_heads, num_partitions). A program takes one
    sequence, one KV head and all the query heads that share it (padded to a tile of at least 16
    rows, tl.dot's smallest), so each K/V tile is read once per KV head, not once per query head.
  * The context is cut into partitions of `partition_size` tokens. A program walks its partition
    in tiles of BLOCK_N tokens; a tile may span several cache blocks (or part of one), since every
    token's address is looked up in the block table: the cache is read in place, never gathered.
  * Softmax is online, in fp32 (exp2 on log2-scaled scores), with fp32 accumulators.
  * With one partition (max_seq_len <= partition_size) the program normalises and writes the
    output itself. Otherwise each program writes its partition's (max, sum, unnormalised acc) and a
    second kernel, one program per (sequence, query head), rescales and combines them.
"""
import os

import torch
import triton
import triton.language as tl

from pagoda_kernels import reference

# Scores are kept in log2 units so the kernels can use exp2: exp(x) == exp2(x * log2(e)).
LOG2_E = 1.4426950408889634

DEFAULT_PARTITION_SIZE = 512
DEFAULT_BLOCK_N = 64
# Partials combined per step of the reduction kernel's loop.
REDUCE_CHUNK = 16

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


@triton.jit
def _paged_decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_max_ptr, partial_sum_ptr, partial_acc_ptr,
    scale_log2,
    stride_q_seq, stride_q_head,
    stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq,
    stride_out_seq, stride_out_head,
    num_heads, num_partitions,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # tokens per tile
    PARTITION_SIZE: tl.constexpr,  # a multiple of BLOCK_N
    WRITE_PARTIALS: tl.constexpr,  # False: one partition, write the output directly
    UPCAST_DOT: tl.constexpr,  # see dot_fp32
    CACHE_FORMAT: tl.constexpr,  # see CACHE_FORMATS
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    partition_start = partition * PARTITION_SIZE
    # Partitions past this sequence's end (it is shorter than max_seq_len) have nothing to do;
    # the reduction never reads their partials.
    if partition_start < seq_len:
        partition_end = tl.minimum(partition_start + PARTITION_SIZE, seq_len)

        group_rows = tl.arange(0, GROUP_PAD)
        row_valid = group_rows < GROUP
        heads = kv_head * GROUP + group_rows
        dims = tl.arange(0, HEAD_DIM)

        q_offsets = (seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head
                     + dims[None, :])
        q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None], other=0.0)

        block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
        head_offset = kv_head * stride_cache_head

        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)

        for tile_start in range(partition_start, partition_end, BLOCK_N):
            token_pos = tile_start + tl.arange(0, BLOCK_N)
            token_valid = token_pos < partition_end
            token_offsets = kv_tile_offsets(block_table_row, token_pos, token_valid, BLOCK_SIZE,
                                            stride_cache_block, stride_cache_token) + head_offset
            # K loaded transposed, [HEAD_DIM, BLOCK_N], so q @ k needs no tl.trans.
            k = load_k_tile(key_cache_ptr, token_offsets, token_valid, dims, q.dtype, HEAD_DIM,
                            CACHE_FORMAT)
            scores = dot_fp32(q, k, UPCAST_DOT) * scale_log2  # [GROUP_PAD, BLOCK_N]
            scores = tl.where(token_valid[None, :], scores, float("-inf"))

            # Every tile holds at least one valid token, so new_max is finite from the first
            # tile on and no exp2(-inf - -inf) appears.
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp2(running_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)

            v = load_v_tile(value_cache_ptr, token_offsets, token_valid, dims, q.dtype, HEAD_DIM,
                            CACHE_FORMAT)
            # P in V's dtype: the tensor cores' bf16/fp16 path; fp32 stays fp32.
            acc = acc * rescale[:, None] + dot_fp32(probs.to(v.dtype), v, UPCAST_DOT)
            running_max = new_max

        if WRITE_PARTIALS:
            # Partials are [num_seqs, num_heads, num_partitions(, HEAD_DIM)], contiguous.
            partial_row = (seq.to(tl.int64) * num_heads + heads) * num_partitions + partition
            tl.store(partial_max_ptr + partial_row, running_max, mask=row_valid)
            tl.store(partial_sum_ptr + partial_row, running_sum, mask=row_valid)
            tl.store(partial_acc_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=row_valid[:, None])
        else:
            out = acc / running_sum[:, None]
            out_offsets = (seq.to(tl.int64) * stride_out_seq + heads[:, None] * stride_out_head
                           + dims[None, :])
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
                     mask=row_valid[:, None])


@triton.jit
def _combine_partitions_kernel(
    partial_max_ptr, partial_sum_ptr, partial_acc_ptr, seq_lens_ptr, out_ptr,
    stride_out_seq, stride_out_head,
    num_heads, num_partitions,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per (sequence, query head): softmax-weighted sum of its partitions."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # min(): a seq_len over max_seq_len (a caller's error) must not read past the partials.
    seq_partitions = tl.minimum(tl.cdiv(seq_len, PARTITION_SIZE), num_partitions)
    row_start = (seq.to(tl.int64) * num_heads + head) * num_partitions
    dims = tl.arange(0, HEAD_DIM)

    # Pass 1: the largest partial max, so that no weight below overflows.
    chunk_max = tl.full([CHUNK], float("-inf"), tl.float32)
    for chunk_start in range(0, seq_partitions, CHUNK):
        parts = chunk_start + tl.arange(0, CHUNK)
        maxes = tl.load(partial_max_ptr + row_start + parts, mask=parts < seq_partitions,
                        other=float("-inf"))
        chunk_max = tl.maximum(chunk_max, maxes)
    global_max = tl.max(chunk_max, axis=0)

    # Pass 2: weights exp2(max_p - global_max); partition 0 always has tokens, so the total is
    # at least its sum, > 0.
    chunk_sum = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for chunk_start in range(0, seq_partitions, CHUNK):
        parts = chunk_start + tl.arange(0, CHUNK)
        part_valid = parts < seq_partitions
        maxes = tl.load(partial_max_ptr + row_start + parts, mask=part_valid,
                        other=float("-inf"))
        sums = tl.load(partial_sum_ptr + row_start + parts, mask=part_valid, other=0.0)
        weights = tl.exp2(maxes - global_max)
        chunk_sum += weights * sums
        accs = tl.load(partial_acc_ptr + (row_start + parts)[:, None] * HEAD_DIM + dims[None, :],
                       mask=part_valid[:, None], other=0.0)
        acc += tl.sum(weights[:, None] * accs, axis=0)
    total_sum = tl.sum(chunk_sum, axis=0)

    out = acc / total_sum
    tl.store(out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty))


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


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float, *,
                           out: torch.Tensor | None = None,
                           partition_size: int = DEFAULT_PARTITION_SIZE,
                           block_n: int | None = None,
                           num_warps: int = 4) -> torch.Tensor:
    """`pagoda_kernels.reference.paged_decode_attention` in Triton.
    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim] (into `out` if
    given). `max_seq_len` (a host int, >= every seq_lens[s]) sizes the grid's partition axis;
    contexts longer than `partition_size` tokens are split across programs and combined.
    `block_n` (default min(64, partition_size)) is the tokens per K/V tile."""
    num_heads, num_kv_heads, head_dim, block_size = check_kv_cache(query, key_cache, value_cache)
    key_cache, value_cache, cache_format = cache_bytes(key_cache, value_cache)
    num_seqs = query.shape[0]
    check_index("block_tables", block_tables, 2, query.device)
    check_index("seq_lens", seq_lens, 1, query.device)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables ({tuple(block_tables.shape)}) and seq_lens "
                         f"({tuple(seq_lens.shape)}) must have one row per sequence ({num_seqs})")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table's "
                         f"{block_tables.shape[1]} blocks of {block_size} tokens")
    if not is_power_of_two(partition_size) or partition_size < 16:
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if block_n is None:
        block_n = min(DEFAULT_BLOCK_N, partition_size)
    if not is_power_of_two(block_n) or not 16 <= block_n <= partition_size:
        raise ValueError(f"block_n must be a power of two in [16, partition_size "
                         f"({partition_size})], got {block_n}")
    out = check_out(out, query)
    if num_seqs == 0 or max_seq_len <= 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    num_partitions = triton.cdiv(max_seq_len, partition_size)
    write_partials = num_partitions > 1
    if write_partials:
        partial_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32,
                                  device=query.device)
        partial_sum = torch.empty_like(partial_max)
        partial_acc = torch.empty(num_seqs, num_heads, num_partitions, head_dim,
                                  dtype=torch.float32, device=query.device)
    else:  # unused by the kernel; any fp32 pointer will do
        partial_max = partial_sum = partial_acc = torch.empty(1, dtype=torch.float32,
                                                              device=query.device)

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, partial_max, partial_sum, partial_acc,
        scale * LOG2_E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_heads, num_partitions,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, PARTITION_SIZE=partition_size, WRITE_PARTIALS=write_partials,
        UPCAST_DOT=needs_upcast_dot(query.dtype, query.device), CACHE_FORMAT=cache_format,
        num_warps=num_warps,
    )
    if write_partials:
        _combine_partitions_kernel[(num_seqs, num_heads)](
            partial_max, partial_sum, partial_acc, seq_lens, out,
            out.stride(0), out.stride(1),
            num_heads, num_partitions,
            HEAD_DIM=head_dim, PARTITION_SIZE=partition_size, CHUNK=REDUCE_CHUNK,
            num_warps=4,
        )
    return out
