"""The Triton attention kernels (pagoda_kernels/triton) against the torch reference ops
(pagoda_kernels/reference.py): paged decode attention, on one partition and split over several, and
prefill attention over a cached prefix, for GQA ratios 1/3/4/8, head dims 64/128, block sizes
8..64, float32 and bfloat16 (float16 once); and the wrappers' errors for what they do not support.
The kernels write into NaN-filled outputs and read caches with NaN in every slot no sequence
owns, so an element left unwritten or a stray read fails the comparison.

On a CUDA machine the kernels run on the GPU; elsewhere under Triton's interpreter, on the CPU
(TRITON_INTERPRET=1, set before the kernels are imported), which is slow: the shapes are small,
and small partitions stand in for long contexts to exercise the split path.
"""
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # triton.jit reads this when it decorates a kernel, so before pagoda_kernels.triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda_kernels import reference  # noqa: E402
from pagoda_kernels.triton import kv_tiles  # noqa: E402
from pagoda_kernels.triton.paged_attention import paged_decode_attention  # noqa: E402
from pagoda_kernels.triton.prefill_attention import prefill_attention  # noqa: E402

TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4),
              torch.float16: dict(atol=5e-3, rtol=5e-3),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class PagedCache:
    """Sequences of `seq_lens` tokens in a paged cache: each one's blocks at shuffled,
    non-contiguous ids, the block tables padded with block 0 to two columns past the longest;
    every slot random, so stale values sit in the spare blocks and past each sequence's end.
    `poisoned()` is the same cache with NaN in every slot no sequence owns: a kernel that reads
    one of them returns NaN."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, block_size, dtype, generator):
        self.block_size = block_size
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 7
        # Block 0 is left unowned: it is also the block tables' padding.
        ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        width = max(blocks_per_seq) + 2
        rows, self.owned = [], torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for n, count in zip(seq_lens, blocks_per_seq):
            row, ids = ids[:count], ids[count:]
            for i, block in enumerate(row):
                self.owned[block, :min(block_size, n - i * block_size)] = True
            rows.append(row + [0] * (width - count))
        self.block_tables = torch.tensor(rows, dtype=torch.int64)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, generator=generator).to(dtype)
        self.value_cache = torch.randn(shape, generator=generator).to(dtype)

    def poisoned(self) -> tuple[torch.Tensor, torch.Tensor]:
        unowned = ~self.owned[:, :, None, None]
        return (self.key_cache.masked_fill(unowned, float("nan")),
                self.value_cache.masked_fill(unowned, float("nan")))


def random_query(num_tokens, num_heads, num_kv_heads, head_dim, dtype, generator, strided):
    if strided:  # q sliced out of a fused [q | k] projection, as a model passes it
        fused = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, generator=generator)
        query = fused.to(dtype)[:, :num_heads]
        assert not query.is_contiguous()
        return query
    return torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer in which any element the kernel leaves unwritten fails the comparison."""
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEVICE)


# --- paged decode attention ------------------------------------------------------------------

# (num_kv_heads, group, head_dim, block_size, seq_lens, partition_size): every GQA ratio 1/4/8
# x head dim 64/128 x block size 8/16/32 on a batch of a length-1 sequence, a block-size
# non-multiple and a long one split over 3 partitions of 64 tokens (the short ones leave
# partitions empty); then batch 1 at length 1, the default partition size (split in two), 19
# partitions (over one chunk of the combining kernel's loop), group 3 (padded rows) and block
# size 64 (a key tile inside one block).
DECODE_CASES = [
    (2 if group < 8 else 1, group, head_dim, block_size, [1, 2 * block_size + 3, 150], 64)
    for group in (1, 4, 8) for head_dim in (64, 128) for block_size in (8, 16, 32)
] + [
    (2, 1, 64, 16, [1], 512),
    (2, 4, 128, 8, [1, 9, 8, 70], 512),
    (2, 4, 64, 16, [600, 31], 512),
    (1, 1, 64, 8, [600, 5], 32),
    (2, 3, 64, 64, [65, 3], 32),
]
DECODE_IDS = [f"kv{kv}-g{g}-d{d}-b{b}-p{p}-len{'_'.join(map(str, lens))}"
              for kv, g, d, b, lens, p in DECODE_CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", DECODE_CASES, ids=DECODE_IDS)
def test_paged_decode_attention_equals_the_reference(case, dtype):
    num_kv_heads, group, head_dim, block_size, seq_lens, partition_size = case
    g = torch.Generator().manual_seed(len(seq_lens) * 1000 + head_dim + block_size)
    cache = PagedCache(seq_lens, num_kv_heads, head_dim, block_size, dtype, g)
    num_heads = num_kv_heads * group
    query = random_query(len(seq_lens), num_heads, num_kv_heads, head_dim, dtype, g,
                         strided=group % 2 == 0)
    scale = head_dim ** -0.5
    # The reference in fp32 on the same (already rounded) values: the exact answer.
    expected = reference.paged_decode_attention(
        query.float(), cache.key_cache.float(), cache.value_cache.float(), cache.block_tables,
        cache.seq_lens, max(seq_lens), scale).to(dtype)

    key_cache, value_cache = cache.poisoned()
    query, key_cache, value_cache, block_tables, lens = on_device(
        query, key_cache, value_cache, cache.block_tables, cache.seq_lens)
    out = nan_like(expected)
    result = paged_decode_attention(query, key_cache, value_cache, block_tables, lens,
                                    max(seq_lens), scale, out=out,
                                    partition_size=partition_size)
    assert result is out and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCES[dtype])


def test_paged_decode_attention_allocates_its_output_and_takes_int32_indices():
    g = torch.Generator().manual_seed(7)
    cache = PagedCache([5, 40], 2, 64, 16, torch.float32, g)
    query = random_query(2, 4, 2, 64, torch.float32, g, strided=False)
    expected = reference.paged_decode_attention(query, cache.key_cache, cache.value_cache,
                                                cache.block_tables, cache.seq_lens, 40, 0.125)
    out = paged_decode_attention(*on_device(query, cache.key_cache, cache.value_cache,
                                            cache.block_tables.int(), cache.seq_lens.int()),
                                 40, 0.125, partition_size=16)
    assert out.shape == query.shape and out.is_contiguous()
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCES[torch.float32])


# --- prefill attention -----------------------------------------------------------------------

# (num_kv_heads, group, head_dim, block_size, query_lens, context_lens, block_m): every GQA ratio
# x head dim x block size on a batch of a one-token chunk over a block-size non-multiple
# prefix, a prompt with nothing cached, and a chunk over a long prefix; then a one-token
# prompt, one prompt alone, 4 tokens per query tile (many tiles) and group 3 (spare rows).
PREFILL_CASES = [
    (2 if group < 8 else 1, group, head_dim, block_size, [1, 19, 40], [block_size + 3, 0, 50],
     None)
    for group in (1, 4, 8) for head_dim in (64, 128) for block_size in (8, 16, 32)
] + [
    (2, 1, 64, 16, [1], [0], None),
    (1, 1, 128, 8, [37], [0], None),
    (1, 4, 64, 16, [29, 50], [100, 3], 16),
    (2, 3, 64, 16, [10, 20], [3, 0], None),
]
PREFILL_IDS = [f"kv{kv}-g{g}-d{d}-b{b}-q{'_'.join(map(str, q))}-c{'_'.join(map(str, c))}"
               for kv, g, d, b, q, c, _ in PREFILL_CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=PREFILL_IDS)
def test_prefill_attention_equals_the_reference(case, dtype):
    num_kv_heads, group, head_dim, block_size, query_lens, context_lens, block_m = case
    g = torch.Generator().manual_seed(sum(query_lens) * 100 + head_dim + block_size)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    cache = PagedCache(seq_lens, num_kv_heads, head_dim, block_size, dtype, g)
    num_heads = num_kv_heads * group
    query = random_query(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, g,
                         strided=group % 2 == 0)
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0)
    lengths = (query_start_loc, torch.tensor(context_lens), cache.seq_lens)
    scale = head_dim ** -0.5
    expected = reference.prefill_attention(
        query.float(), cache.key_cache.float(), cache.value_cache.float(), cache.block_tables,
        *lengths, max(query_lens), max(seq_lens), scale).to(dtype)

    key_cache, value_cache = cache.poisoned()
    query, key_cache, value_cache, block_tables, *lengths = on_device(
        query, key_cache, value_cache, cache.block_tables, *lengths)
    out = nan_like(expected)
    result = prefill_attention(query, key_cache, value_cache, block_tables, *lengths,
                               max(query_lens), max(seq_lens), scale, out=out, block_m=block_m)
    assert result is out and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCES[dtype])


def test_float16_and_a_decode_batch_through_both_kernels():
    """float16 (the tensor-core path beside bf16's), and the prefill kernel on one new token per
    sequence, which is decode attention: both against the reference and each other."""
    g = torch.Generator().manual_seed(11)
    seq_lens = [1, 21, 90]
    cache = PagedCache(seq_lens, 2, 64, 16, torch.float16, g)
    query = random_query(3, 8, 2, 64, torch.float16, g, strided=True)
    expected = reference.paged_decode_attention(
        query.float(), cache.key_cache.float(), cache.value_cache.float(), cache.block_tables,
        cache.seq_lens, 90, 0.125).half()
    query, key_cache, value_cache, block_tables, lens = on_device(
        query, *cache.poisoned(), cache.block_tables, cache.seq_lens)
    decode_out = paged_decode_attention(query, key_cache, value_cache, block_tables, lens, 90,
                                        0.125, out=nan_like(expected), partition_size=32)
    query_start_loc = torch.arange(4, device=DEVICE)
    prefill_out = prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                    lens - 1, lens, 1, 90, 0.125, out=nan_like(expected))
    torch.testing.assert_close(decode_out.cpu(), expected, **TOLERANCES[torch.float16])
    torch.testing.assert_close(prefill_out.cpu(), expected, **TOLERANCES[torch.float16])


# --- the wrappers' errors --------------------------------------------------------------------

def decode_args(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32):
    query = torch.randn(2, num_heads, head_dim, dtype=dtype, device=DEVICE)
    cache = torch.zeros(6, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    block_tables = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    seq_lens = torch.tensor([3, block_size + 1], device=DEVICE)
    return [query, cache, cache.clone(), block_tables, seq_lens, block_size + 1, 0.125]


def prefill_args(**kwargs):
    """One new token per sequence over its cached prefix: the decode batch as a prefill."""
    query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, scale = \
        decode_args(**kwargs)
    query_start_loc = torch.tensor([0, 1, 2], device=DEVICE)
    return [query, key_cache, value_cache, block_tables, query_start_loc, seq_lens - 1,
            seq_lens, 1, max_seq_len, scale]


def test_the_error_test_arguments_are_valid():
    paged_decode_attention(*decode_args())
    prefill_attention(*prefill_args())


@pytest.mark.parametrize("kernel,make_args", [(paged_decode_attention, decode_args),
                                              (prefill_attention, prefill_args)],
                         ids=["decode", "prefill"])
@pytest.mark.parametrize("shape,message", [
    (dict(head_dim=80), "head_dim must be a power of two"),
    (dict(head_dim=8), "head_dim must be a power of two >= 16"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(num_heads=6, num_kv_heads=4), "must be a multiple of num_kv_heads"),
    (dict(dtype=torch.float64), "dtype torch.float64 is unsupported"),
])
def test_unsupported_shapes_and_dtypes_are_refused(kernel, make_args, shape, message):
    with pytest.raises(ValueError, match=message):
        kernel(*make_args(**shape))


def test_mismatched_or_non_contiguous_inputs_are_refused():
    args = decode_args()
    with pytest.raises(ValueError, match="must share a dtype"):
        paged_decode_attention(args[0], args[1].bfloat16(), *args[2:])
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        paged_decode_attention(args[0].transpose(1, 2).contiguous().transpose(1, 2), *args[1:])
    with pytest.raises(ValueError, match="must be contiguous"):
        paged_decode_attention(args[0], args[1].transpose(0, 1).contiguous().transpose(0, 1),
                               *args[2:])
    with pytest.raises(ValueError, match="must both be"):
        paged_decode_attention(args[0], args[1][:, :, :1], *args[2:])
    with pytest.raises(ValueError, match="seq_lens must be a 1-d int32/int64"):
        paged_decode_attention(*args[:4], args[4].float(), *args[5:])
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode_attention(*args[:4], args[4][:1], *args[5:])
    with pytest.raises(ValueError, match="exceeds the block table"):
        paged_decode_attention(*args[:5], 33, args[6])
    with pytest.raises(ValueError, match="out must be"):
        paged_decode_attention(*args, out=torch.empty_like(args[0]).bfloat16())
    with pytest.raises(ValueError, match="partition_size must be a power of two"):
        paged_decode_attention(*args, partition_size=48)
    p_args = prefill_args()
    with pytest.raises(ValueError, match="num_seqs \\+ 1 entries"):
        prefill_attention(*p_args[:4], p_args[4][:2], *p_args[5:])
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        prefill_attention(*p_args, block_m=24)
    with pytest.raises(ValueError, match="must hold a token's 32 query heads"):
        prefill_attention(*prefill_args(num_heads=32, num_kv_heads=1), block_m=16)

def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(kv_tiles, "INTERPRETED", False)
    args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in decode_args()]
    with pytest.raises(ValueError, match="need CUDA tensors"):
        paged_decode_attention(*args)
