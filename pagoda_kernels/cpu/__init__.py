"""CPU kernels in C (built on first use, see build.py): paged decode attention, causal prefill
attention for whole prompts, the KV cache write, the element-wise layer ops, greedy sampling
and the sampler's random draws (race_sample.c), the bf16 and fp32 panel matmuls (AMX,
AVX512-BF16 or AVX-512 FMA; AVX2 and FMA without AVX-512), int8 weight-only and w8a8 matmuls,
matmuls on GGUF blocks (matmul_gguf.c), and a decoder layer's work around attention chained
into two calls, or a decode step's layers into one (blocks.c). Each computes what its torch counterpart computes
(pagoda_kernels/reference.py for attention and the cache write, the modules of
services/worker/models/llama.py and the sampler for the rest), which stands in for it where it
cannot run: another device or dtype, no C compiler, or PAGODA_CPU_KERNELS=0. The panel matmul,
int8, GGUF and layer-block wrappers live in panels.py, int8.py, gguf.py and blocks.py,
re-exported here; bind.py binds the C functions."""
import functools

import torch

from pagoda_kernels.cpu.bind import DTYPE_SUFFIX as _SUFFIX
from pagoda_kernels.cpu.bind import bound_function as _function
from pagoda_kernels.cpu.bind import data_ptr as _ptr
from pagoda_kernels.cpu.build import load, unavailable_reason
from pagoda_kernels.reference import cache_row_width
from pagoda_kernels.cpu.blocks import (Q8_CACHE_CODES, BlockLinear, bf16_block_linear, attention_input,
                                f32_block_linear,
                                attention_output_mlp, decode_layers, decode_weights,
                                gguf_block_linear, int8_block_linear, layer_blocks_available,
                                silu_mul)
from pagoda_kernels.cpu.gguf import gguf_dequantize, gguf_matmul, gguf_simd_available, set_gguf_simd
from pagoda_kernels.cpu.panels import (bf16_linear, bf16_matmul_available, bf16_matmul_paths,
                                f32_linear, f32_matmul_available, pack_bf16_weight,
                                pack_f32_weight, set_bf16_matmul, set_bf16_matmul_path,
                                f32_block_rows, f32_block_rows_now, set_f32_block_rows,
                                set_f32_matmul)
from pagoda_kernels.cpu.int8 import (INT8_PATHS, int8_kernels_available, int8_linear, int8_paths,
                              pack_int8_weight, set_int8_path, unpack_int8_weight)

__all__ = [
    "load", "unavailable_reason", "available_for",
    # attention and the KV cache
    "attention_simd_available", "attention_simd_path", "set_attention_simd", "supports",
    "write_kv_cache",
    "paged_decode_attention", "prefill_paths", "prefill_simd_path", "set_prefill_path",
    "causal_prefill_supports",
    "causal_prefill_attention",
    # layer ops, sampling
    "rms_norm", "rotary_", "greedy_sample", "race_sample_available", "race_sample",
    "random_sample",
    # pagoda_kernels/cpu/panels.py: the bf16 and fp32 panel matmuls
    "set_bf16_matmul", "bf16_matmul_available", "bf16_matmul_paths", "set_bf16_matmul_path",
    "pack_bf16_weight", "bf16_linear", "set_f32_matmul", "f32_matmul_available",
    "pack_f32_weight", "f32_linear", "set_f32_block_rows", "f32_block_rows",
    "f32_block_rows_now",
    # pagoda_kernels/cpu/blocks.py: the layer blocks
    "Q8_CACHE_CODES", "BlockLinear", "bf16_block_linear", "f32_block_linear", "int8_block_linear",
    "gguf_block_linear",
    "layer_blocks_available", "attention_input", "attention_output_mlp", "decode_weights",
    "decode_layers", "silu_mul",
    # pagoda_kernels/cpu/gguf.py and int8.py
    "gguf_dequantize", "gguf_matmul", "gguf_simd_available", "set_gguf_simd",
    "INT8_PATHS", "int8_kernels_available", "int8_linear", "int8_paths", "pack_int8_weight",
    "set_int8_path", "unpack_int8_weight",
]


def attention_simd_available() -> bool:
    """Whether decode attention has a vector path here: AVX-512 (every cache dtype), or AVX2 and
    FMA without AVX-512 (fp32 and bf16 caches; 8-bit ones run the portable loop)."""
    return attention_simd_path() != ""


def attention_simd_path() -> str:
    """"avx512", "avx2" or "" (none): the decode attention vector loop this build has."""
    lib = load()
    return "" if lib is None else ["", "avx2", "avx512"][lib.attention_simd_available()]


def set_attention_simd(on: bool) -> None:
    """Use (default) or bypass the vector decode attention, for comparing it with the portable
    loop on one machine. Process-wide."""
    lib = load()
    if lib is not None:
        lib.set_attention_simd(int(on))


def available_for(x: torch.Tensor) -> bool:
    """Whether the element-wise kernels run on this tensor (CPU, float32/bfloat16, built)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and load() is not None


def supports(dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int,
             head_dim: int, block_size: int) -> bool:
    """Whether `paged_decode_attention` runs for this model and cache here (the kernel's limits:
    16 query heads per KV head, head_dim 256, block_size 128)."""
    return (device.type == "cpu" and dtype in _SUFFIX and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= 16 and head_dim <= 256 and block_size <= 128
            and _function("paged_decode", dtype) is not None)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As pagoda_kernels.reference.write_kv_cache: key/value [T, num_kv_heads, head_dim] (each token's
    heads contiguous, tokens at any stride) -> the cache slots `slot_mapping` [T] int64,
    quantized into an 8-bit cache."""
    tokens, num_kv_heads, head_dim = key.shape
    if _Q8_CODES.get(key_cache.dtype) is not None:
        return _write_kv_cache_q8(key, value, key_cache, value_cache, slot_mapping)
    fn = _function("kv_cache_write", None)
    if fn is None:
        raise RuntimeError(f"cpu kv cache write is unavailable: {unavailable_reason()}")
    if (key.dtype != key_cache.dtype or value.dtype != key.dtype
            or value_cache.dtype != key.dtype):
        raise ValueError(f"kv cache write: {key.dtype} / {value.dtype} rows into "
                         f"{key_cache.dtype} / {value_cache.dtype} caches")
    for t in (key, value):
        if t.stride(2) != 1 or t.stride(1) != head_dim or t.shape != key.shape:
            raise ValueError(f"kv cache write: rows must be [{tokens}, {num_kv_heads}, {head_dim}] "
                             f"with each token's heads contiguous, got {tuple(t.shape)} "
                             f"strides {t.stride()}")
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.shape[2:] == (num_kv_heads, head_dim) and value_cache.shape == key_cache.shape
    slots = slot_mapping.contiguous()
    assert slots.dtype == torch.int64 and slots.shape == (tokens,)
    size = key.element_size()
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    rc = fn(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
            key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), tokens,
            num_kv_heads * head_dim * size, num_slots)
    if rc != 0:
        raise IndexError(f"kv cache slots must lie in [0, {num_slots}), got "
                         f"{slots.min().item()}..{slots.max().item()}")


# The 8-bit cache dtypes as pagoda_kernels/cpu/kv_quant.h numbers them.
_Q8_CODES = Q8_CACHE_CODES  # kv_quant.h's 8-bit formats (pagoda_kernels/cpu/blocks.py)


def _write_kv_cache_q8(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """write_kv_cache into an 8-bit cache: each row quantized as pagoda_kernels.reference.quantize_kv."""
    tokens, num_kv_heads, head_dim = key.shape
    fn = _function("kv_cache_write_q8", None)
    if fn is None:
        raise RuntimeError(f"cpu kv cache write is unavailable: {unavailable_reason()}")
    if key.dtype not in _SUFFIX or value.dtype != key.dtype or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"kv cache write: {key.dtype} / {value.dtype} rows into "
                         f"{key_cache.dtype} / {value_cache.dtype} caches")
    for t in (key, value):
        if t.stride(2) != 1 or t.stride(1) != head_dim or t.shape != key.shape:
            raise ValueError(f"kv cache write: rows must be [{tokens}, {num_kv_heads}, {head_dim}] "
                             f"with each token's heads contiguous, got {tuple(t.shape)} "
                             f"strides {t.stride()}")
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.shape[2:] == (num_kv_heads, cache_row_width(key_cache.dtype, head_dim))
    assert value_cache.shape == key_cache.shape
    slots = slot_mapping.contiguous()
    assert slots.dtype == torch.int64 and slots.shape == (tokens,)
    size = key.element_size()
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    rc = fn(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
            key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), tokens, num_kv_heads,
            head_dim, int(key.dtype == torch.bfloat16), _Q8_CODES[key_cache.dtype], num_slots)
    if rc == -1:
        raise IndexError(f"kv cache slots must lie in [0, {num_slots}), got "
                         f"{slots.min().item()}..{slots.max().item()}")
    if rc != 0:
        raise ValueError(f"kv cache write: head_dim {head_dim} into a {key_cache.dtype} cache")


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each row (last dim) contiguous, rows at a fixed stride."""
    return x.dim() == 2 and x.stride(1) == 1


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float) -> torch.Tensor:
    """As pagoda_kernels.reference.paged_decode_attention, reading the cache blocks in place (an 8-bit
    cache's rows converted as they are read).
    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]."""
    del max_seq_len  # the kernel walks each sequence's own length
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    cache_code = _Q8_CODES.get(key_cache.dtype)
    # The kernel reads the cache as [.., num_kv_heads, row]: query's dtype and head_dim, or an
    # 8-bit format's rows (pagoda_kernels/reference.py).
    assert key_cache.dtype == value_cache.dtype
    assert cache_code is not None or key_cache.dtype == query.dtype
    assert (value_cache.shape == key_cache.shape
            and key_cache.shape[3] == cache_row_width(key_cache.dtype, head_dim))
    assert block_tables.dtype == torch.int64 and seq_lens.dtype == torch.int64
    assert block_tables.dim() == 2 and block_tables.shape[0] == seq_lens.shape[0] == num_seqs
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
    fn = _function("paged_decode" if cache_code is None else "paged_decode_q8", query.dtype)
    if fn is None:
        raise RuntimeError(f"cpu paged attention is unavailable for {query.dtype}: "
                           f"{unavailable_reason() or 'dtype not supported'}")
    args = (query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale)
    rc = fn(*args) if cache_code is None else fn(*args, cache_code)
    if rc != 0:
        raise ValueError(f"cpu paged attention cannot run {num_heads} heads / {num_kv_heads} KV "
                         f"heads, head_dim {head_dim}, block_size {block_size}")
    return out


def prefill_paths() -> list[str]:
    """The prefill attention paths this machine runs: "portable" everywhere the kernels build,
    "avx512" where they were built with AVX-512, "avx2" where with AVX2 and FMA but no AVX-512,
    "avx512_bf16" (bf16 only) where with AVX512-BF16 too, "amx" (bf16 only) where AMX is granted
    too."""
    lib = load()
    if lib is None:
        return []
    simd = prefill_simd_path()
    return (["portable"] + ([simd] if simd else [])
            + (["avx512_bf16"] if lib.prefill_dpbf16_available() else [])
            + (["amx"] if lib.prefill_amx_available() else []))


@functools.cache  # asked per layer per step; the build does not change within a process
def prefill_simd_path() -> str:
    """"avx512", "avx2" or "" (none): the prefill attention vector loop this build has. Where
    there is none the CPU backend leaves prompts to torch's SDPA, which ran 4.5-14x faster than
    the portable loop (an AMD Zen 3, fp32 and bf16, prompts of 16 to 1,024 tokens)."""
    lib = load()
    return "" if lib is None else ["", "avx2", "avx512"][lib.prefill_simd_available()]


def set_prefill_path(path: str) -> None:
    """Run prefill attention on `path` ("amx" for bf16 is the fastest where it runs; each path
    falls to the next one down where it cannot run: amx, avx512_bf16, avx512, portable; fp32
    takes avx512 on the first three; "avx2" is the vector path of a build without AVX-512), for
    comparing the paths on one machine. Process-wide; the default is the fastest."""
    lib = load()
    if lib is not None:
        lib.set_prefill_simd(int(path != "portable"))
        lib.set_prefill_amx(int(path == "amx"))
        lib.set_prefill_dpbf16(int(path in ("amx", "avx512_bf16")))


def causal_prefill_supports(dtype: torch.dtype, device: torch.device, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> bool:
    """Whether `causal_prefill_attention` runs these shapes here (head_dim 64 or 128, query
    heads a multiple of at least one KV head, float32 or bfloat16 on the CPU, kernels built)."""
    return (device.type == "cpu" and dtype in _SUFFIX and head_dim in (64, 128)
            and num_kv_heads >= 1 and num_heads % num_kv_heads == 0
            and _function("causal_prefill", dtype) is not None)


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] with each token's heads contiguous (tokens at any stride)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def causal_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """As pagoda_kernels.reference.causal_prefill_attention, on the packed tokens with no padding:
    query [T, num_heads, head_dim], key/value [T, num_kv_heads, head_dim] (each token's heads
    contiguous, tokens at any stride), query_start_loc [num_seqs + 1] int64
    -> [T, num_heads, head_dim], written into `out` (contiguous, query's shape and dtype) when
    given. Raises ValueError for shapes the kernel does not run (see `causal_prefill_supports`)
    and for query_start_loc not running from 0 to T in order, before writing anything."""
    del max_query_len  # the kernel walks each sequence's own length
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if not (key.dtype == value.dtype == query.dtype and key.shape == value.shape
            and key.shape[0] == num_tokens and key.shape[2] == head_dim):
        raise ValueError(f"causal prefill: query {tuple(query.shape)} {query.dtype}, key "
                         f"{tuple(key.shape)} {key.dtype}, value {tuple(value.shape)} "
                         f"{value.dtype} do not match")
    if (query_start_loc.dtype != torch.int64 or query_start_loc.dim() != 1
            or query_start_loc.numel() == 0):
        raise ValueError(f"causal prefill: query_start_loc must be 1-d int64, not empty, got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    query, key, value = (_heads_contiguous(t) for t in (query, key, value))
    starts = query_start_loc.contiguous()
    fn = _function("causal_prefill", query.dtype)
    if fn is None:
        raise RuntimeError(f"cpu prefill attention is unavailable for {query.dtype}: "
                           f"{unavailable_reason() or 'dtype not supported'}")
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype)
    elif not (out.shape == query.shape and out.dtype == query.dtype and out.is_contiguous()):
        raise ValueError(f"causal prefill: out must be contiguous {tuple(query.shape)} "
                         f"{query.dtype}, got {tuple(out.shape)} {out.dtype}")
    rc = fn(query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
            value.stride(0), starts.data_ptr(), starts.shape[0] - 1, num_tokens, num_heads,
            num_kv_heads, head_dim, scale, out.data_ptr())
    if rc == -1:
        raise ValueError(f"cpu prefill attention cannot run {num_heads} heads / {num_kv_heads} "
                         f"KV heads, head_dim {head_dim}")
    if rc == -3:
        raise ValueError(f"causal prefill: query_start_loc must run from 0 to {num_tokens} in "
                         f"order, got {starts.tolist()}")
    if rc != 0:
        raise MemoryError(f"cpu prefill attention: out of memory for {num_tokens} tokens")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [T, hidden] -> a new tensor. With `residual` [T, hidden] (contiguous), first
    residual += x in place and the sum is normalised."""
    assert x.dim() == 2 and weight.is_contiguous() and weight.dtype == x.dtype
    assert weight.shape == (x.shape[1],)
    if not _rows_contiguous(x):
        x = x.contiguous()
    assert residual is None or (residual.is_contiguous() and residual.shape == x.shape
                                and residual.dtype == x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype)
    _function("rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), _ptr(residual), weight.data_ptr(), out.data_ptr(), x.shape[0],
        x.shape[1], eps)
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] in place (heads contiguous, tokens at any stride) with a
    cos_sin table [max_positions, 2, head_dim] of [cos, cos], [-sin, sin]; returns x."""
    tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim and cos_sin.is_contiguous()
    assert positions.dtype == torch.int64 and cos_sin.dtype == x.dtype
    assert cos_sin.shape[1:] == (2, head_dim) and positions.shape == (tokens,)
    positions = positions.contiguous()
    rc = _function("rotary", x.dtype)(x.data_ptr(), x.stride(0), positions.data_ptr(),
                                      cos_sin.data_ptr(), tokens, heads, head_dim,
                                      cos_sin.shape[0])
    if rc != 0:  # checked before anything is written, as torch's index_select would
        raise _positions_outside(positions, cos_sin)
    return x


def _positions_outside(positions: torch.Tensor, cos_sin: torch.Tensor) -> IndexError:
    return IndexError(f"rotary positions must lie in [0, {cos_sin.shape[0]}), got "
                      f"{positions.min().item()}..{positions.max().item()}")


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (argmax token ids [N] int64, their logprobs [N] float32), the first
    index on ties as torch.argmax (NaNs skipped, where torch.argmax would pick the first);
    reads bf16 logits without a float copy."""
    logits = _unit_stride_rows(logits)
    rows, vocab = logits.shape
    token_ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    _function("greedy_sample", logits.dtype)(logits.data_ptr(), logits.stride(0), rows, vocab,
                                             token_ids.data_ptr(), logprobs.data_ptr())
    return token_ids, logprobs


def race_sample_available(x: torch.Tensor) -> bool:
    """Whether `race_sample` and `random_sample` run on this tensor: CPU, float32 or bfloat16,
    kernels built with AVX-512 F/BW/VL or with AVX2 and FMA (elsewhere the sampler keeps its torch
    ops)."""
    if not available_for(x):
        return False
    lib = load()
    return bool(lib.race_sample_available())


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if _rows_contiguous(x) else x.contiguous()


def _per_row(name: str, values: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    if values.shape != (rows,):
        raise ValueError(f"{name}: shape {tuple(values.shape)}, one per row ({rows}) expected")
    return values.to(dtype).contiguous()


def race_sample(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The exponential race of services/worker/sampler.py (`exponential_race`) over x [N, V]
    (scaled and filtered logits, -inf excluded), row r with the 32-bit key keys[r]
    (`noise_keys`): [N] int64 tokens, the torch version's draws up to the last bit of its
    logarithms (a NaN key is never drawn), with no [N, V] temporaries."""
    x = _unit_stride_rows(x)
    rows, vocab = x.shape
    # The low 32 bits as int32 (read as uint32 in C), held here: a temporary's pointer would
    # dangle during the call.
    keys = _per_row("race_sample keys", keys, rows, torch.int32)
    tokens = torch.empty(rows, dtype=torch.int64)
    rc = _function("race_sample", x.dtype)(x.data_ptr(), x.stride(0), rows, vocab,
                                          keys.data_ptr(), tokens.data_ptr())
    if rc != 0:
        raise RuntimeError("race_sample does not run here (neither AVX-512 BW/VL nor AVX2)")
    return tokens


def random_sample(logits: torch.Tensor, temperature: torch.Tensor, is_greedy: torch.Tensor,
                  keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's temperature-only path in one call: logits [N, V] (float32 or bf16, read
    without a float copy), no penalties, filters or top logprobs. Greedy rows take the argmax
    (as `greedy_sample`), the others the race of `race_sample` over logits / temperature.
    Three passes over each row, the last two from cache. Returns (tokens [N] int64, their
    logprobs under the raw logits [N] float32)."""
    logits = _unit_stride_rows(logits)
    rows, vocab = logits.shape
    temperature = _per_row("random_sample temperature", temperature, rows, torch.float32)
    greedy = _per_row("random_sample is_greedy", is_greedy, rows, torch.uint8)
    keys = _per_row("random_sample keys", keys, rows, torch.int32)
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    rc = _function("random_sample", logits.dtype)(
        logits.data_ptr(), logits.stride(0), rows, vocab, temperature.data_ptr(),
        greedy.data_ptr(), keys.data_ptr(), tokens.data_ptr(), logprobs.data_ptr())
    if rc != 0:
        raise RuntimeError("random_sample does not run here (neither AVX-512 BW/VL nor AVX2)")
    return tokens, logprobs
