"""Torch reference ops for attention over the paged KV cache.

They define what the Triton kernels must compute, and they are what the torch attention backend
runs on the CPU. Layouts:
  key_cache / value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables             [num_seqs, max_blocks] int64, padded with block 0 (masked out here)
  query                    [num_tokens, num_heads, head_dim], sequences laid out back to back

8-bit caches (`--kv-cache-dtype`, the cache tensors' dtype says which): float8_e4m3fn / float8_e5m2
hold each value saturated to the format's range, with no scale; int8 caches are
[num_blocks, block_size, num_kv_heads, head_dim + 4]: each (token, KV head) row's head_dim int8
values, then its float32 scale (absmax / 127) in the row's last 4 bytes, so that a block and its
scales move together (swap, copy-on-write). Writes quantize the step's K/V; reads dequantize to
the query's dtype.

Lengths that size a padded buffer (`max_query_len`, `max_seq_len`) are host ints, so that no op
here waits on the device. Padded key positions are masked, never trusted: their K/V may be stale
values of another sequence, so the cache must hold finite numbers (CacheEngine zero-fills it).
"""
import torch
import torch.nn.functional as F

KV_CACHE_TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                         "int8": torch.int8}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_SCALE_BYTES = 4  # the float32 scale at the end of an int8 cache row


def is_quantized_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8 or cache.dtype in FP8_DTYPES


def cache_row_width(cache_dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one (token, KV head) row of a cache of this dtype."""
    return head_dim + INT8_SCALE_BYTES if cache_dtype == torch.int8 else head_dim


def cache_head_dim(cache: torch.Tensor) -> int:
    return cache.shape[-1] - INT8_SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] -> its cache rows [..., cache_row_width] of `cache_dtype`. fp8: each
    value rounded to nearest (even) after saturating to the format's largest finite value, so a
    large value never becomes inf or NaN. int8: round(x / scale) with scale = absmax / 127 per
    row (a row of zeros gets scale 0)."""
    x32 = x.float()
    if cache_dtype in FP8_DTYPES:
        limit = torch.finfo(cache_dtype).max
        return x32.clamp(-limit, limit).to(cache_dtype)
    assert cache_dtype == torch.int8, cache_dtype
    scale = x32.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, x32 / scale, 0.0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat((q, scale.view(torch.int8)), -1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., cache_row_width] -> values [..., head_dim] in `dtype`."""
    if rows.dtype in FP8_DTYPES:
        return rows.to(dtype)
    head_dim = cache_head_dim(rows)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, num_kv_heads, head_dim] -> the cache slots `slot_mapping` [T]
    (slot = block_id * block_size + offset), quantized for an 8-bit cache."""
    num_kv_heads, width = key_cache.shape[2:]
    if is_quantized_cache(key_cache):
        # As bytes: index_copy_ has no float8 kernels on the CPU.
        for x, cache in ((key, key_cache), (value, value_cache)):
            rows = quantize_kv(x, cache.dtype).view(torch.uint8)
            cache.view(torch.uint8).view(-1, num_kv_heads, width).index_copy_(0, slot_mapping,
                                                                               rows)
        return
    key_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, value)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
              num_blocks: int, dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_blocks` blocks of each sequence, made contiguous:
    -> key, value [num_seqs, num_blocks * block_size, num_kv_heads, head_dim], dequantized to
    `dtype` from an 8-bit cache."""
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, width = key_cache.shape
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    # index_select is several times faster than advanced indexing on the CPU.
    shape = (num_seqs, num_blocks * block_size, num_kv_heads, width)
    if not is_quantized_cache(key_cache):
        return (key_cache.index_select(0, block_ids).view(shape),
                value_cache.index_select(0, block_ids).view(shape))
    assert dtype is not None, "an 8-bit cache is read into a dtype"
    return tuple(dequantize_kv(c.view(torch.uint8).index_select(0, block_ids).view(c.dtype)
                               .view(shape), dtype)
                 for c in (key_cache, value_cache))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float) -> torch.Tensor:
    """One query token per sequence attending to its first `seq_lens[s]` cached tokens.
    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    key, value = gather_kv(key_cache, value_cache, block_tables, num_blocks, query.dtype)
    max_len = num_blocks * block_size
    visible = torch.arange(max_len, device=query.device) < seq_lens[:, None]  # [num_seqs, max_len]
    # The query heads that share a KV head become that head's queries: grouped-query attention
    # without repeating K/V.
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _pad_index(query_start_loc: torch.Tensor, num_tokens: int, max_query_len: int) -> torch.Tensor:
    """For each flat token, its row in a [num_seqs * max_query_len] padded layout."""
    num_seqs = query_start_loc.shape[0] - 1
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=query_lens.device),
                                           query_lens, output_size=num_tokens)
    token = torch.arange(num_tokens, device=query_lens.device)
    return seq_of_token * max_query_len + (token - query_start_loc[seq_of_token])


def _to_padded(x: torch.Tensor, pad_index: torch.Tensor, num_seqs: int, max_len: int) -> torch.Tensor:
    """[num_tokens, heads, head_dim] -> [num_seqs, heads, max_len, head_dim], zeros in the padding."""
    padded = x.new_zeros(num_seqs * max_len, *x.shape[1:]).index_copy_(0, pad_index, x)
    return padded.view(num_seqs, max_len, *x.shape[1:]).transpose(1, 2)


def _from_padded(out: torch.Tensor, pad_index: torch.Tensor) -> torch.Tensor:
    """[num_seqs, heads, max_len, head_dim] -> [num_tokens, heads, head_dim]."""
    num_seqs, heads, max_len, head_dim = out.shape
    return out.transpose(1, 2).reshape(num_seqs * max_len, heads, head_dim).index_select(0, pad_index)


def causal_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             query_start_loc: torch.Tensor, max_query_len: int,
                             scale: float) -> torch.Tensor:
    """Prompts with nothing cached before them: causal attention within each sequence, on the
    step's own K/V. query [T, num_heads, head_dim], key/value [T, num_kv_heads, head_dim],
    query_start_loc [num_seqs + 1] -> [T, num_heads, head_dim]."""
    num_tokens = query.shape[0]
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs * max_query_len == num_tokens:
        # Prompts of one length (one prompt, or a batch of equal ones): [num_seqs, len, ...]
        # views of the flat tensors, no padded copies.
        def split(x):
            return x.view(num_seqs, max_query_len, *x.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(split(query), split(key), split(value),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(query.shape)
    pad_index = _pad_index(query_start_loc, num_tokens, max_query_len)
    q = _to_padded(query, pad_index, num_seqs, max_query_len)
    k = _to_padded(key, pad_index, num_seqs, max_query_len)
    v = _to_padded(value, pad_index, num_seqs, max_query_len)
    # Top-left causal alignment is right here: a real query never sees a padded key (those
    # come after it), and the padded queries' rows are dropped.
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return _from_padded(out, pad_index)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                      max_seq_len: int, scale: float) -> torch.Tensor:
    """Prompt chunks over a cached prefix: query i of sequence s sits at absolute position
    context_lens[s] + i and attends to cached tokens [0, context_lens[s] + i]. The step's own K/V
    must already be in the cache. query [T, num_heads, head_dim] -> [T, num_heads, head_dim]."""
    num_tokens = query.shape[0]
    num_seqs = query_start_loc.shape[0] - 1
    block_size = key_cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    key, value = gather_kv(key_cache, value_cache, block_tables, num_blocks, query.dtype)
    pad_index = _pad_index(query_start_loc, num_tokens, max_query_len)
    q = _to_padded(query, pad_index, num_seqs, max_query_len)
    device = query.device
    query_pos = context_lens[:, None] + torch.arange(max_query_len, device=device)  # [seqs, q]
    key_pos = torch.arange(num_blocks * block_size, device=device)
    # Causal, aligned bottom-right by the context; the length bound keeps padded query rows
    # (past the sequence's end) off padded keys. Key 0 is always visible, so no row is empty.
    visible = ((key_pos[None, None, :] <= query_pos[:, :, None])
               & (key_pos[None, None, :] < seq_lens[:, None, None]))  # [seqs, q, keys]
    out = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    return _from_padded(out, pad_index)
