"""Torch reference ops for attention over the paged KV cache.

They define what the Triton kernels must compute, and they are what the torch attention backend
runs on the CPU. Layouts:
  key_cache / value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables             [num_seqs, max_blocks] int64, padded with block 0 (masked out here)
  query                    [num_tokens, num_heads, head_dim], sequences laid out back to back

Lengths that size a padded buffer (`max_query_len`, `max_seq_len`) are host ints, so that no op
here waits on the device. Padded key positions are masked, never trusted: their K/V may be stale
values of another sequence, so the cache must hold finite numbers (CacheEngine zero-fills it).
"""
import torch
import torch.nn.functional as F


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, num_kv_heads, head_dim] -> the cache slots `slot_mapping` [T]
    (slot = block_id * block_size + offset)."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
              num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `num_blocks` blocks of each sequence, made contiguous:
    -> key, value [num_seqs, num_blocks * block_size, num_kv_heads, head_dim]."""
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    # index_select is several times faster than advanced indexing on the CPU.
    shape = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    return (key_cache.index_select(0, block_ids).view(shape),
            value_cache.index_select(0, block_ids).view(shape))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float) -> torch.Tensor:
    """One query token per sequence attending to its first `seq_lens[s]` cached tokens.
    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    key, value = gather_kv(key_cache, value_cache, block_tables, num_blocks)
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
    key, value = gather_kv(key_cache, value_cache, block_tables, num_blocks)
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
