"""`--kv-cache-dtype`: 8-bit KV caches (fp8 e4m3 / e5m2, int8 with a scale per row).

The quantization round trip's error bounds; the CPU C kernels and the Triton kernels (under the
interpreter without a GPU) against the torch reference (pagoda_kernels/reference.py) on a small grid of
shapes, with NaN in every cache slot no sequence owns and in the output buffers; block moves
(swap, copy-on-write) keeping values and scales; the block count for a cache size; the config's
errors; and the default model's greedy output with an fp8 cache against its model-dtype cache.
"""
import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # before pagoda_kernels.triton is imported (as tests/conftest.py does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagoda_kernels import cpu, reference  # noqa: E402
from pagoda_kernels.reference import cache_row_width, dequantize_kv, quantize_kv  # noqa: E402
from services.worker.cache_engine import CacheEngine  # noqa: E402
from shared.config import CacheConfig, ConfigError  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from tests.helpers import greedy_agreement, greedy_outputs  # noqa: E402
# The int8 weights' agreement test's prompts and counts, and its memoised reference outputs.
from tests.test_int8_weights import (MAX_TOKENS, MIN_AGREEING, PROMPTS, TOP_K,  # noqa: E402
                                     reference_greedy)

CACHE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
CACHE_IDS = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
MODEL_DTYPES = [torch.float32, torch.bfloat16]
MODEL_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# Attention over dequantized values: kernels and reference read the same 8-bit values, so
# they differ only by summation order (and the output's rounding to bf16).
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4),
              torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# --- quantize / dequantize -------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS.get)
def test_round_trip_stays_within_half_a_step_and_large_values_saturate(cache_dtype):
    g = torch.Generator().manual_seed(0)
    # Rows over many magnitudes, subnormal ranges of both fp8 formats included.
    x = torch.randn(64, 4, 64, generator=g) * torch.logspace(-6, 2, 64)[:, None, None]
    back = dequantize_kv(quantize_kv(x, cache_dtype), torch.float32)
    err = (back - x).abs()
    if cache_dtype == torch.int8:
        step = x.abs().amax(-1, keepdim=True) / 127  # one scale per (token, head) row
        assert (err <= step / 2 * (1 + 1e-5) + 1e-30).all()
    else:
        info = torch.finfo(cache_dtype)
        mantissa_bits = 3 if cache_dtype == torch.float8_e4m3fn else 2
        subnormal_step = info.smallest_normal / 2 ** mantissa_bits
        bound = torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1),
                              torch.tensor(subnormal_step / 2))
        assert (err <= bound * (1 + 1e-6)).all()
    # Far past the format's range: the largest finite value (fp8), never inf or NaN; int8
    # rows keep their extremes (their scale is absmax / 127).
    big = torch.tensor([[1e6, -1e6] + [0.5] * 62, [3e38, -3e38] + [0.5] * 62])[None]
    rows = dequantize_kv(quantize_kv(big, cache_dtype), torch.float32)
    assert torch.isfinite(rows).all()
    if cache_dtype != torch.int8:
        limit = torch.finfo(cache_dtype).max
        assert rows[0, :, :2].tolist() == [[limit, -limit], [limit, -limit]]
    else:
        assert rows[0, :, :2].flatten().tolist() == pytest.approx([1e6, -1e6, 3e38, -3e38],
                                                                  rel=1e-6)
    zero = dequantize_kv(quantize_kv(torch.zeros(2, 1, 64), cache_dtype), torch.float32)
    assert (zero == 0).all()


# --- the kernels against the reference ---------------------------------------------------------

def _random_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, g):
    """A cache of random (finite) rows as a real write leaves them."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (quantize_kv(torch.randn(shape, generator=g) * 2, cache_dtype),
            quantize_kv(torch.randn(shape, generator=g), cache_dtype))


def _poisoned(cache: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """The cache with NaN in every slot not `owned` [num_blocks, block_size]: fp8 NaN codes, or
    an int8 row with a NaN scale."""
    out = cache.clone()
    b = _bytes(out)
    if cache.dtype == torch.int8:
        scales = b[..., -4:]
        scales[~owned] = torch.tensor([float("nan")]).view(torch.uint8)
    else:
        b[~owned] = 0x7F  # NaN in both fp8 formats
    return out


class Sequences:
    """Sequences of `seq_lens` tokens at shuffled blocks, tables padded with block 0 (owned by
    none)."""

    def __init__(self, seq_lens, block_size, g):
        blocks = [-(-n // block_size) for n in seq_lens]
        self.num_blocks = sum(blocks) + 3
        ids = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()
        width = max(blocks) + 1
        rows = []
        self.owned = torch.zeros(self.num_blocks, block_size, dtype=torch.bool)
        for n, count in zip(seq_lens, blocks):
            row, ids = ids[:count], ids[count:]
            for i, block in enumerate(row):
                self.owned[block, :min(block_size, n - i * block_size)] = True
            rows.append(row + [0] * (width - count))
        self.block_tables = torch.tensor(rows, dtype=torch.int64)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)


# (num_heads, num_kv_heads, head_dim, block_size, seq_lens): MHA, GQA 4 and 8 (and 3), head dims
# 64 / 128 / 32, block sizes 8..64, lengths off block boundaries.
DECODE_SHAPES = [
    (4, 4, 64, 16, [1, 17, 40]),
    (8, 2, 64, 8, [9, 33]),
    (8, 1, 128, 32, [70, 3]),
    (6, 2, 32, 64, [65, 1]),
]
SHAPE_IDS = [f"h{h}-kv{kv}-d{d}-b{b}" for h, kv, d, b, _ in DECODE_SHAPES]
# Enough sequences that one work item takes several KV heads (pagoda_kernels/cpu/paged_attention.h).
CPU_DECODE_SHAPES = DECODE_SHAPES + [(9, 3, 64, 16, [1, 5, 16, 17, 40, 3, 9, 64])]
CPU_SHAPE_IDS = SHAPE_IDS + ["h9-kv3-d64-b16-8seqs"]


def _write_case(cache_dtype, dtype, num_kv_heads, head_dim, g):
    tokens, num_blocks, block_size = 11, 6, 8
    # Rows one token apart at a stride, as slices of a fused projection.
    fused = torch.randn(tokens, 3 * num_kv_heads, head_dim, generator=g) * 3
    fused[0, 0, 0] = 1e6  # saturates (fp8), or one row's large scale (int8)
    fused = fused.to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads:2 * num_kv_heads]
    width = cache_row_width(cache_dtype, head_dim)
    key_cache = torch.empty(num_blocks, block_size, num_kv_heads, width, dtype=cache_dtype)
    _bytes(key_cache).random_(0, 0x70, generator=g)  # stale rows in every slot
    value_cache = key_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    return key, value, key_cache, value_cache, slots


def _assert_same_rows(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bytes equal; int8 codes may differ by one where x / scale is a tie under another
    rounding of the division (the scales themselves are equal)."""
    if got.dtype != torch.int8:
        assert torch.equal(_bytes(got), _bytes(expected))
        return
    assert torch.equal(_bytes(got)[..., -4:], _bytes(expected)[..., -4:])
    diff = (got[..., :-4].int() - expected[..., :-4].int()).abs()
    assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=MODEL_IDS.get)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS.get)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (1, 128), (3, 32)])
def test_cpu_kv_cache_write_quantizes_as_the_reference(cache_dtype, dtype, num_kv_heads,
                                                       head_dim):
    if cpu.load() is None:
        pytest.skip(f"cpu kernels unavailable: {cpu.unavailable_reason()}")
    g = torch.Generator().manual_seed(num_kv_heads * 100 + head_dim)
    key, value, key_cache, value_cache, slots = _write_case(cache_dtype, dtype, num_kv_heads,
                                                            head_dim, g)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slots)
    cpu.write_kv_cache(key, value, key_cache, value_cache, slots)
    _assert_same_rows(key_cache, expected_k)  # unwritten slots unchanged as well
    _assert_same_rows(value_cache, expected_v)
    with pytest.raises(IndexError):
        cpu.write_kv_cache(key, value, key_cache, value_cache, slots + 10_000)


def _decode_case(shape, cache_dtype, dtype, seed):
    num_heads, num_kv_heads, head_dim, block_size, seq_lens = shape
    g = torch.Generator().manual_seed(seed)
    seqs = Sequences(seq_lens, block_size, g)
    key_cache, value_cache = _random_cache(seqs.num_blocks, block_size, num_kv_heads, head_dim,
                                           cache_dtype, g)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(dtype)
    return seqs, key_cache, value_cache, query, head_dim ** -0.5


@pytest.mark.parametrize("path", ["avx512", "portable"])
@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=MODEL_IDS.get)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS.get)
@pytest.mark.parametrize("shape", CPU_DECODE_SHAPES, ids=CPU_SHAPE_IDS)
def test_cpu_paged_decode_reads_8bit_caches_as_the_reference(shape, cache_dtype, dtype, path):
    """On the AVX-512 path (head_dim 64 / 128, up to 8 query heads per KV head; the other
    shapes fall to the portable loop) and on the portable loop."""
    if not cpu.supports(dtype, torch.device("cpu"), shape[0], shape[1], shape[2], shape[3]):
        pytest.skip(f"cpu decode attention unavailable: {cpu.unavailable_reason()}")
    if path == "avx512" and cpu.attention_simd_path() != "avx512":
        pytest.skip("the 8-bit caches' vector loop needs AVX-512 (this build: "
                    f"{cpu.attention_simd_path() or 'no vector loop'})")
    seqs, key_cache, value_cache, query, scale = _decode_case(shape, cache_dtype, dtype,
                                                              sum(shape[4]) + shape[2])
    # The reference in fp32 on the same 8-bit values: the exact answer.
    expected = reference.paged_decode_attention(
        query.float(), key_cache, value_cache, seqs.block_tables, seqs.seq_lens,
        max(shape[4]), scale).to(dtype)
    cpu.set_attention_simd(path == "avx512")
    try:
        out = cpu.paged_decode_attention(query, _poisoned(key_cache, seqs.owned),
                                         _poisoned(value_cache, seqs.owned), seqs.block_tables,
                                         seqs.seq_lens, max(shape[4]), scale)
    finally:
        cpu.set_attention_simd(True)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


# --- Triton (the CUDA path; Triton's interpreter on the CPU) -------------------------------------

def _triton():
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and TRITON_INTERPRET=1 was not set before triton was imported")
    from pagoda_kernels.triton import kv_cache, paged_attention, prefill_attention
    return kv_cache, paged_attention, prefill_attention


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=MODEL_IDS.get)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS.get)
def test_triton_kv_cache_write_quantizes_as_the_reference(cache_dtype, dtype):
    kv_cache, _, _ = _triton()
    g = torch.Generator().manual_seed(3)
    key, value, key_cache, value_cache, slots = _write_case(cache_dtype, dtype, 2, 64, g)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slots)
    padded = torch.cat((slots, torch.tensor([-1])))  # a padding token writes nothing
    key, value = (torch.cat((t, t[:1])) for t in (key, value))
    key_cache, value_cache, key, value, padded = (t.to(DEVICE) for t in (
        key_cache, value_cache, key, value, padded))
    kv_cache.write_kv_cache(key, value, key_cache, value_cache, padded)
    _assert_same_rows(key_cache.cpu(), expected_k)
    _assert_same_rows(value_cache.cpu(), expected_v)


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=MODEL_IDS.get)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=CACHE_IDS.get)
@pytest.mark.parametrize("shape", DECODE_SHAPES[:2] + DECODE_SHAPES[3:],
                         ids=SHAPE_IDS[:2] + SHAPE_IDS[3:])
def test_triton_attention_reads_8bit_caches_as_the_reference(shape, cache_dtype, dtype):
    """Decode split over partitions of 32 tokens, and prefill chunks over a cached prefix."""
    _, paged, prefill = _triton()
    seqs, key_cache, value_cache, query, scale = _decode_case(shape, cache_dtype, dtype,
                                                              sum(shape[4]) + 7)
    max_len = max(shape[4])
    expected = reference.paged_decode_attention(query.float(), key_cache, value_cache,
                                                seqs.block_tables, seqs.seq_lens, max_len, scale)
    poisoned = [_poisoned(c, seqs.owned).to(DEVICE) for c in (key_cache, value_cache)]
    tables, lens = seqs.block_tables.to(DEVICE), seqs.seq_lens.to(DEVICE)
    out = _nan_like(query)
    paged.paged_decode_attention(query.to(DEVICE), *poisoned, tables, lens, max_len, scale,
                                 out=out, partition_size=32, block_n=16)
    torch.testing.assert_close(out.cpu(), expected.to(dtype), **TOLERANCES[dtype])

    # Each sequence's last (up to) 3 tokens as a prompt chunk over the rest.
    query_lens = [min(3, n) for n in shape[4]]
    context_lens = torch.tensor([n - q for n, q in zip(shape[4], query_lens)])
    starts = torch.tensor([0] + query_lens).cumsum(0)
    chunk = torch.randn(sum(query_lens), *query.shape[1:],
                        generator=torch.Generator().manual_seed(5)).to(dtype)
    expected = reference.prefill_attention(chunk.float(), key_cache, value_cache,
                                           seqs.block_tables, starts, context_lens,
                                           seqs.seq_lens, max(query_lens), max_len, scale)
    out = _nan_like(chunk)
    prefill.prefill_attention(chunk.to(DEVICE), *poisoned, tables, starts.to(DEVICE),
                              context_lens.to(DEVICE), lens, max(query_lens), max_len, scale,
                              out=out)
    torch.testing.assert_close(out.cpu(), expected.to(dtype), **TOLERANCES[dtype])


# --- the cache: blocks for a size, swap and copy ----------------------------------------------

def _model(dtype, num_layers=2, num_kv_heads=2, head_dim=64):
    """What CacheEngine reads of a ModelConfig."""
    return SimpleNamespace(dtype=dtype, num_layers=num_layers, num_kv_heads=num_kv_heads,
                           head_dim=head_dim)


def _cache_config(kv_cache_dtype, **kw):
    return CacheConfig(block_size=16, gpu_memory_utilization=None, kv_cache_space_gib=0.01,
                       swap_space_gib=0.01, num_gpu_blocks_override=None,
                       enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype, **kw)


def test_an_8bit_cache_holds_twice_the_blocks_of_bf16_in_the_same_space():
    space = 1 << 30
    bf16 = _model(torch.bfloat16, num_layers=30, num_kv_heads=3, head_dim=64)  # the default's
    blocks = {name: space // CacheEngine.get_cache_block_size_bytes(_cache_config(name), bf16)
              for name in ("auto", "fp8_e4m3", "fp8_e5m2", "int8")}
    assert blocks["fp8_e4m3"] == blocks["fp8_e5m2"]
    assert 2 * blocks["auto"] <= blocks["fp8_e4m3"] <= 2 * blocks["auto"] + 1
    # int8 rows carry their 4-byte scale: 64 + 4 bytes where bf16 has 128.
    assert blocks["int8"] == space // (2 * 30 * 16 * 3 * (64 + 4))
    fp32 = _model(torch.float32, num_layers=30, num_kv_heads=3, head_dim=64)
    fp32_blocks = space // CacheEngine.get_cache_block_size_bytes(_cache_config("auto"), fp32)
    fp8_blocks = space // CacheEngine.get_cache_block_size_bytes(_cache_config("fp8_e4m3"), fp32)
    assert 4 * fp32_blocks <= fp8_blocks < 4 * (fp32_blocks + 1)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_swap_and_copy_move_8bit_blocks_with_their_scales(name):
    config = _cache_config(name, num_device_blocks=6, num_cpu_blocks=4)
    engine = CacheEngine(config, _model(torch.bfloat16), torch.device(DEVICE))
    g = torch.Generator().manual_seed(1)
    for k_cache, v_cache in engine.device_cache:
        assert k_cache.dtype == engine.dtype and k_cache.shape[-1] == cache_row_width(
            engine.dtype, 64)
        for c in (k_cache, v_cache):
            _bytes(c).copy_(torch.randint(0, 0x70, c.shape, dtype=torch.uint8, generator=g))
    before = [[_bytes(c).cpu().clone() for c in layer] for layer in engine.device_cache]
    engine.swap_out([(1, 0), (4, 3)])
    for layer in engine.device_cache:
        for c in layer:
            _bytes(c)[1] = 0
            _bytes(c)[4] = 0
    engine.swap_in([(0, 2), (3, 5)])
    engine.copy([(2, 0)])
    for layer, old in zip(engine.device_cache, before):
        for c, o in zip(layer, old):
            now = _bytes(c).cpu()
            assert torch.equal(now[2], o[1]) and torch.equal(now[5], o[4])
            assert torch.equal(now[0], o[1]) and torch.equal(now[3], o[3])


# --- config -------------------------------------------------------------------------------------

def test_kv_cache_dtype_flag_and_its_errors():
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8"]))
    assert args.kv_cache_dtype == "fp8"
    assert EngineArgs(kv_cache_dtype="fp8").create_engine_config(
    ).cache_config.kv_cache_dtype == "fp8_e4m3"
    assert EngineArgs().create_engine_config().cache_config.kv_cache_dtype == "auto"
    for bad in ("fp16", "FP8", "e4m3", ""):
        with pytest.raises(ConfigError, match="kv_cache_dtype") as e:
            EngineArgs(kv_cache_dtype=bad).create_engine_config()
        assert e.value.field == "kv_cache_dtype"


# --- the default model ----------------------------------------------------------------------------

def test_fp8_cache_greedy_tokens_agree_with_the_model_dtype_cache(llm):
    """The session's LLM (fp32 cache) against the same settings with an fp8 e4m3 cache, which
    holds 4x its blocks."""
    from pagoda import LLM
    fp8 = LLM(kv_cache_space_gib=0.25, swap_space=0.05, kv_cache_dtype="fp8")
    try:
        worker, ref_worker = fp8.llm_engine.executor.worker, llm.llm_engine.executor.worker
        assert worker.cache_engine.dtype == torch.float8_e4m3fn
        assert ref_worker.cache_engine.dtype == torch.float32
        ref_blocks = ref_worker.cache_engine.num_device_blocks
        assert ref_blocks * 4 <= worker.cache_engine.num_device_blocks < (ref_blocks + 1) * 4
        ref = reference_greedy(llm)  # generated once a session
        out = greedy_outputs(fp8, PROMPTS, MAX_TOKENS, TOP_K)
    finally:
        del fp8
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in out)
    agreeing, lines = greedy_agreement(ref, out, TOP_K, ("fp32 cache", "fp8 cache"))
    print(f"\nfp8 vs fp32 cache: {agreeing}/{len(PROMPTS)} agree over {MAX_TOKENS} tokens")
    for line in lines:
        print("  ", line)
    assert agreeing >= MIN_AGREEING, "\n".join(lines)


def test_model_config_dtype_is_what_auto_stores():
    """--kv-cache-dtype auto keeps the model dtype (bf16 here), unchanged from before the flag."""
    config = dataclasses.replace(_cache_config("auto"), num_device_blocks=1, num_cpu_blocks=0)
    engine = CacheEngine(config, _model(torch.bfloat16), torch.device("cpu"))
    assert engine.dtype == torch.bfloat16
    assert engine.device_cache[0][0].shape == (1, 16, 2, 64)
