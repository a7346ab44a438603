"""Inputs of the Triton kernels' checks and timings: a paged K/V cache, prefill chunks over
cached prefixes, the KV cache write, RMSNorm with a residual, and rotary."""
import types

from .plan import Plan


def paged_cache(seq_lens: list, num_kv_heads: int, head_dim: int, block_size: int, dtype,
                device, generator):
    """A paged K/V cache holding sequences of `seq_lens` tokens at shuffled block ids (block 0
    left to the tables' padding) -> (key_cache, value_cache, block_tables, seq_lens)."""
    import torch
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    ids = (torch.randperm(num_blocks - 1, generator=generator, device=device) + 1).tolist()
    width = max(blocks_per_seq)
    rows = []
    for count in blocks_per_seq:
        row, ids = ids[:count], ids[count:]
        rows.append(row + [0] * (width - count))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    return (key_cache, value_cache, torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(seq_lens, dtype=torch.int64, device=device))


def prefill_inputs(p: Plan, query_lens: list, context_lens: list, dtype, device, generator):
    """Everything prefill_attention takes, for chunks of `query_lens` tokens over cached
    prefixes of `context_lens` (their own K/V already in the cache)."""
    import torch
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    k, v, tables, lens = paged_cache(seq_lens, p.num_kv_heads, p.head_dim, p.block_size,
                                     dtype, device, generator)
    q = torch.randn(sum(query_lens), p.num_heads, p.head_dim,
                    generator=generator, device=device).to(dtype)
    starts = torch.tensor([0] + query_lens, dtype=torch.int64).cumsum(0).to(device)
    contexts = torch.tensor(context_lens, dtype=torch.int64, device=device)
    return (q, k, v, tables, starts, contexts, lens, max(query_lens), max(seq_lens),
            p.head_dim ** -0.5)


def kv_write_inputs(p: Plan, dtype, device, generator):
    """key/value as slices of a fused qkv projection, caches with room to spare, a distinct
    random slot per token."""
    import torch
    tokens, kv_width = p.elementwise_tokens, p.num_kv_heads * p.head_dim
    qkv = torch.randn(tokens, p.num_heads * p.head_dim + 2 * kv_width,
                      generator=generator, device=device).to(dtype)
    _, k, v = qkv.split([p.num_heads * p.head_dim, kv_width, kv_width], dim=-1)
    num_blocks = -(-tokens // p.block_size) + 8
    shape = (num_blocks, p.block_size, p.num_kv_heads, p.head_dim)
    key_cache = torch.zeros(shape, dtype=dtype, device=device)
    value_cache = torch.zeros(shape, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * p.block_size, generator=generator, device=device)[:tokens]
    return (k.view(tokens, p.num_kv_heads, p.head_dim),
            v.view(tokens, p.num_kv_heads, p.head_dim), key_cache, value_cache, slots)


def norm_inputs(p: Plan, dtype, device, generator):
    import torch
    shape = (p.elementwise_tokens, p.hidden)
    x = (torch.randn(shape, generator=generator, device=device) * 2).to(dtype)
    residual = (torch.randn(shape, generator=generator, device=device) * 2).to(dtype)
    weight = (torch.rand(p.hidden, generator=generator, device=device) * 2).to(dtype)
    return x, residual, weight


def rotary_table(p: Plan, max_positions: int, dtype, device):
    """The model's RotaryEmbedding with Llama-3 scaling (inverse frequencies not a plain
    power)."""
    from services.worker.models.llama import RotaryEmbedding
    config = types.SimpleNamespace(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=1024))
    return RotaryEmbedding(config, p.head_dim, max_positions, dtype).to(device)


def rotary_inputs(p: Plan, max_positions: int, dtype, device, generator):
    """The q|k view of a fused qkv projection, and random positions."""
    import torch
    heads = p.num_heads + 2 * p.num_kv_heads
    qkv = (torch.randn(p.elementwise_tokens, heads * p.head_dim, generator=generator,
                       device=device) * 2).to(dtype)
    qk = qkv[:, :(p.num_heads + p.num_kv_heads) * p.head_dim].view(
        p.elementwise_tokens, p.num_heads + p.num_kv_heads, p.head_dim)
    positions = torch.randint(0, max_positions, (p.elementwise_tokens,), generator=generator,
                              device=device)
    return qkv, qk, positions
