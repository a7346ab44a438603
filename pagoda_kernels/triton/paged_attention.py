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
import torch
import triton
import triton.language as tl

from pagoda_kernels.triton.kv_tiles import (LOG2_E, cache_bytes, check_index, check_kv_cache,
                                         check_out, dot_fp32, is_power_of_two, kv_tile_offsets,
                                         load_k_tile, load_v_tile, needs_upcast_dot)

DEFAULT_PARTITION_SIZE = 512
DEFAULT_BLOCK_N = 64
# Partials combined per step of the reduction kernel's loop.
REDUCE_CHUNK = 16


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
    CACHE_FORMAT: tl.constexpr,  # see kv_tiles.CACHE_FORMATS
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
