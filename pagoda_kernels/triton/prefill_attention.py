"""Prefill attention in Triton: prompt chunks of several sequences, over their paged KV cache.

Computes exactly what `pagoda_kernels.reference.prefill_attention` computes (the reference these kernels
are tested against): the queries of sequence s are rows query_start_loc[s] ..
query_start_loc[s + 1] - 1 of the flat query; query i sits at absolute position
context_lens[s] + i and attends to cached tokens [0, context_lens[s] + i], below seq_lens[s].
The step's own K/V must already be in the cache. Grouped-query attention: query head h reads KV
head h // (num_heads // num_kv_heads). Layouts, as in the reference:
  query / out              [num_tokens, num_heads, head_dim], sequences back to back
  key_cache / value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables             [num_seqs, max_blocks] int32/int64, padded with block 0
  query_start_loc          [num_seqs + 1]; context_lens, seq_lens [num_seqs] (int32/int64)
An 8-bit cache is read as the decode kernel reads it (kv_tiles.py).

How the work is split:
  * Grid (query tiles, num_kv_heads, num_seqs), query tiles = cdiv(max_query_len,
    tokens per tile). A program takes BLOCK_M rows, each a (query token, query head) pair: the
    GROUP query heads of one KV head for BLOCK_M // GROUP consecutive tokens of one sequence, so
    each K/V tile is loaded once for all the heads that share it. Programs past their sequence's
    query length exit at once.
  * It walks the keys from position 0 to the tile's last query position in tiles of BLOCK_N,
    every token's address looked up in the block table (the cache is read in place), with
    Q @ K^T and P @ V on tl.dot, and an online softmax in fp32 (exp2 on log2-scaled scores).
"""
import torch
import triton
import triton.language as tl

from pagoda_kernels.triton.kv_tiles import (LOG2_E, cache_bytes, check_index, check_kv_cache,
                                         check_out, dot_fp32, is_power_of_two, kv_tile_offsets,
                                         load_k_tile, load_v_tile, needs_upcast_dot)


def default_tile_sizes(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): fp32 tiles are twice the registers of 16-bit ones, so smaller."""
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32
    return 64, 64


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr,
    query_start_loc_ptr, context_lens_ptr, seq_lens_ptr, out_ptr,
    scale_log2,
    stride_q_token, stride_q_head,
    stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq,
    stride_out_token, stride_out_head,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # rows per program: (token, head) pairs, a power of two >= GROUP
    BLOCK_N: tl.constexpr,  # keys per tile
    UPCAST_DOT: tl.constexpr,  # see kv_tiles.dot_fp32
    CACHE_FORMAT: tl.constexpr,  # see kv_tiles.CACHE_FORMATS
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    query_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = (tl.load(query_start_loc_ptr + seq + 1) - query_start).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    tile_first_token = query_tile * TOKENS_PER_TILE
    if tile_first_token < query_len:
        rows = tl.arange(0, BLOCK_M)
        token_in_seq = tile_first_token + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        # The rows past TOKENS_PER_TILE * GROUP (BLOCK_M not a multiple of GROUP) are spare.
        row_valid = (rows < TOKENS_PER_TILE * GROUP) & (token_in_seq < query_len)
        query_pos = context_len + token_in_seq
        dims = tl.arange(0, HEAD_DIM)

        q_offsets = ((query_start + token_in_seq).to(tl.int64)[:, None] * stride_q_token
                     + heads[:, None] * stride_q_head + dims[None, :])
        q = tl.load(query_ptr + q_offsets, mask=row_valid[:, None], other=0.0)

        block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
        head_offset = kv_head * stride_cache_head

        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

        # Causal: no row in this tile sees past its last token's position.
        tile_last_token = tl.minimum(tile_first_token + TOKENS_PER_TILE, query_len) - 1
        keys_end = tl.minimum(context_len + tile_last_token + 1, seq_len)
        for key_start in range(0, keys_end, BLOCK_N):
            key_pos = key_start + tl.arange(0, BLOCK_N)
            key_valid = key_pos < keys_end
            key_offsets = kv_tile_offsets(block_table_row, key_pos, key_valid, BLOCK_SIZE,
                                          stride_cache_block, stride_cache_token) + head_offset
            k = load_k_tile(key_cache_ptr, key_offsets, key_valid, dims, q.dtype, HEAD_DIM,
                            CACHE_FORMAT)  # [HEAD_DIM, BLOCK_N]
            scores = dot_fp32(q, k, UPCAST_DOT) * scale_log2  # [BLOCK_M, BLOCK_N]
            # key_valid holds key_pos < seq_len (keys_end <= seq_len).
            visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))

            # Key 0 is visible to every row and lies in the first tile, so running_max is finite
            # from then on, even for a row that sees none of a later tile's keys.
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            rescale = tl.exp2(running_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)

            v = load_v_tile(value_cache_ptr, key_offsets, key_valid, dims, q.dtype, HEAD_DIM,
                            CACHE_FORMAT)
            acc = acc * rescale[:, None] + dot_fp32(probs.to(v.dtype), v, UPCAST_DOT)
            running_max = new_max

        out = acc / running_sum[:, None]
        out_offsets = ((query_start + token_in_seq).to(tl.int64)[:, None] * stride_out_token
                       + heads[:, None] * stride_out_head + dims[None, :])
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                      max_seq_len: int, scale: float, *, out: torch.Tensor | None = None,
                      block_m: int | None = None, block_n: int | None = None,
                      num_warps: int = 4) -> torch.Tensor:
    """`pagoda_kernels.reference.prefill_attention` in Triton.
    query [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim] (into `out` if
    given). `max_query_len` (a host int, >= every sequence's query length) sizes the grid.
    `block_m` (rows of (token, head) pairs) and `block_n` (keys per tile) default by dtype."""
    num_heads, num_kv_heads, head_dim, block_size = check_kv_cache(query, key_cache, value_cache)
    key_cache, value_cache, cache_format = cache_bytes(key_cache, value_cache)
    for name, t, dims in (("block_tables", block_tables, 2),
                          ("query_start_loc", query_start_loc, 1),
                          ("context_lens", context_lens, 1), ("seq_lens", seq_lens, 1)):
        check_index(name, t, dims, query.device)
    num_seqs = query_start_loc.shape[0] - 1
    if (num_seqs < 0 or block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs
            or seq_lens.shape[0] != num_seqs):
        raise ValueError(f"query_start_loc ({tuple(query_start_loc.shape)}) must have num_seqs + 1 "
                         f"entries for block_tables ({tuple(block_tables.shape)}), context_lens "
                         f"({tuple(context_lens.shape)}) and seq_lens ({tuple(seq_lens.shape)}) "
                         f"with num_seqs rows")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table's "
                         f"{block_tables.shape[1]} blocks of {block_size} tokens")
    group = num_heads // num_kv_heads
    default_m, default_n = default_tile_sizes(query.dtype, head_dim)
    if block_m is None:
        block_m = max(default_m, triton.next_power_of_2(group))
    if block_n is None:
        block_n = default_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if not is_power_of_two(size) or size < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if block_m < group:
        raise ValueError(f"block_m ({block_m}) must hold a token's {group} query heads")
    out = check_out(out, query)
    if num_seqs == 0 or query.shape[0] == 0 or max_query_len <= 0:
        return out

    tokens_per_tile = block_m // group
    grid = (triton.cdiv(max_query_len, tokens_per_tile), num_kv_heads, num_seqs)
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables,
        query_start_loc, context_lens, seq_lens, out,
        scale * LOG2_E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, UPCAST_DOT=needs_upcast_dot(query.dtype, query.device),
        CACHE_FORMAT=cache_format, num_warps=num_warps,
    )
    return out
