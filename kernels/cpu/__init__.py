"""CPU kernels in C (built on first use, see build.py): paged decode attention, causal prefill
attention for whole prompts, the KV cache write, the element-wise layer ops, greedy sampling,
the bf16 matmul on AMX, int8 weight-only and w8a8 matmuls, matmuls on GGUF blocks
(matmul_gguf.c), and a bf16 decoder layer's work around attention chained into two calls. Each
computes what its torch counterpart computes (kernels/reference.py for attention and the cache
write, the modules of services/worker/models/llama.py and the sampler for the rest), which
stands in for it where it cannot run: another device or dtype, no C compiler, or
PAGODA_CPU_KERNELS=0."""
import ctypes
from collections.abc import Callable

import torch

from kernels.cpu.build import load, unavailable_reason

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "paged_decode": ([_P, _I64, _P, _P, _P, _I64, _P, _P, _INT, _INT, _INT, _INT, _INT, _F], _INT),
    "causal_prefill": ([_P, _I64, _P, _I64, _P, _I64, _P, _INT, _I64, _INT, _INT, _INT, _F, _P],
                       _INT),
    "rms_norm": ([_P, _I64, _P, _P, _P, _I64, _INT, _F], None),
    "rotary": ([_P, _I64, _P, _P, _I64, _INT, _INT, _I64], _INT),
    "greedy_sample": ([_P, _I64, _I64, _I64, _P, _P], None),
    "matmul_amx_pack": ([_P, _I64, _I64, _INT, _P], _INT),
    "matmul_amx": ([_P, _I64, _I64, _P, _P, _I64, _I64, _INT, _P], _INT),
    "matmul_int8": ([_P, _I64, _I64, _INT, _P, _P, _P, _P, _I64, _I64, _INT, _INT, _INT, _P],
                    _INT),
    "kv_cache_write": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64], _INT),
    "attention_input": ([_P, _P, _P, _F, _P, _P, _I64, _I64, _I64, _P, _P, _I64, _INT, _INT, _P,
                         _P], _INT),
    "attention_output_mlp": ([_P, _I64, _P, _P, _P, _P, _F, _P, _P, _P, _P, _I64, _I64, _I64, _P,
                              _P, _P], _INT),
    "gguf_matmul": ([_P, _I64, _I64, _I64, _INT, _P, _P, _P, _I64, _P, _P, _I64], _INT),
    "gguf_dequantize": ([_INT, _P, _P, _P, _I64, _I64, _P, _I64, _P], _INT),
}
_bound: dict[tuple[str, torch.dtype], object] = {}


def _function(name: str, dtype: torch.dtype | None):
    """The C function `name` for dtype (its `_f32` / `_bf16` variant), or the one function of
    that name for dtype None; None where the kernels or that dtype are unavailable."""
    fn = _bound.get((name, dtype))
    if fn is None:
        lib = load()
        if lib is None or (dtype is not None and dtype not in _SUFFIX):
            return None
        fn = getattr(lib, name if dtype is None else f"{name}_{_SUFFIX[dtype]}")
        fn.argtypes, fn.restype = _SIGNATURES[name]
        _bound[(name, dtype)] = fn
    return fn


def attention_simd_available() -> bool:
    """Whether decode attention has its AVX-512 path here (built with AVX-512 for this CPU)."""
    lib = load()
    return lib is not None and bool(lib.attention_simd_available())


def set_attention_simd(on: bool) -> None:
    """Use (default) or bypass the AVX-512 decode attention, for comparing it with the portable
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
    """As kernels.reference.write_kv_cache: key/value [T, num_kv_heads, head_dim] (each token's
    heads contiguous, tokens at any stride) -> the cache slots `slot_mapping` [T] int64."""
    tokens, num_kv_heads, head_dim = key.shape
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


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each row (last dim) contiguous, rows at a fixed stride."""
    return x.dim() == 2 and x.stride(1) == 1


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float) -> torch.Tensor:
    """As kernels.reference.paged_decode_attention, reading the cache blocks in place.
    query [num_seqs, num_heads, head_dim] -> [num_seqs, num_heads, head_dim]."""
    del max_seq_len  # the kernel walks each sequence's own length
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    # The kernel reads every buffer as query's dtype, and the cache as [.., num_kv_heads, head_dim].
    assert key_cache.dtype == value_cache.dtype == query.dtype
    assert value_cache.shape == key_cache.shape and key_cache.shape[3] == head_dim
    assert block_tables.dtype == torch.int64 and seq_lens.dtype == torch.int64
    assert block_tables.dim() == 2 and block_tables.shape[0] == seq_lens.shape[0] == num_seqs
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype)
    fn = _function("paged_decode", query.dtype)
    if fn is None:
        raise RuntimeError(f"cpu paged attention is unavailable for {query.dtype}: "
                           f"{unavailable_reason() or 'dtype not supported'}")
    rc = fn(query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale)
    if rc != 0:
        raise ValueError(f"cpu paged attention cannot run {num_heads} heads / {num_kv_heads} KV "
                         f"heads, head_dim {head_dim}, block_size {block_size}")
    return out


def prefill_paths() -> list[str]:
    """The prefill attention paths this machine runs: "portable" everywhere the kernels build,
    "avx512" where they were built with AVX-512, "amx" (bf16 only) where AMX is granted too."""
    lib = load()
    if lib is None:
        return []
    return (["portable"] + (["avx512"] if lib.prefill_simd_available() else [])
            + (["amx"] if lib.prefill_amx_available() else []))


def set_prefill_path(path: str) -> None:
    """Run prefill attention on `path` ("amx" for bf16 is the fastest where it runs; each path
    falls to the next one down where it cannot run: amx, avx512, portable), for comparing the
    paths on one machine. Process-wide; the default is the fastest."""
    lib = load()
    if lib is not None:
        lib.set_prefill_simd(int(path != "portable"))
        lib.set_prefill_amx(int(path == "amx"))


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
    """As kernels.reference.causal_prefill_attention, on the packed tokens with no padding:
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
    index on ties as torch.argmax; reads bf16 logits without a float copy."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    token_ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    _function("greedy_sample", logits.dtype)(logits.data_ptr(), logits.stride(0), rows, vocab,
                                             token_ids.data_ptr(), logprobs.data_ptr())
    return token_ids, logprobs


_amx_on = True


def set_amx_matmul(on: bool) -> None:
    """Pack bf16 weights for the AMX matmul where it runs (default), or leave them to oneDNN, for
    comparing the two on one machine. Applies to weights packed afterwards."""
    global _amx_on
    _amx_on = on


def amx_available() -> bool:
    """Whether the bf16 AMX matmul runs here: built for a CPU with AMX, and the OS grants it."""
    lib = load()
    return lib is not None and bool(lib.matmul_amx_available())


def pack_amx_weight(weight: torch.Tensor, gate_up: bool = False,
                    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = torch.empty,
                    ) -> torch.Tensor | None:
    """A bf16 weight [N, K] on the CPU rearranged for `amx_linear` (same size, in memory from
    `empty(shape, dtype)`), or None where that does not run: no AMX, another dtype or device,
    N or K not a multiple of 32. With `gate_up` the weight is [gate; up] and the matmul returns
    SiLU(gate) * up."""
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or not _amx_on or not amx_available()):
        return None
    n, k = weight.shape
    if n % 32 or k % 32:
        return None
    weight = weight.detach().contiguous()
    packed = empty((n * k,), dtype=torch.bfloat16)
    rc = _function("matmul_amx_pack", torch.bfloat16)(weight.data_ptr(), n, k, int(gate_up),
                                                       packed.data_ptr())
    assert rc == 0, rc
    return packed


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int, gate_up: bool = False) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias) with W packed by `pack_amx_weight`: [..., out_features],
    or [..., out_features / 2] = SiLU(gate) * up for a `gate_up` weight. (Called ~200 times a
    decode step: the checks are the ones the C code cannot make.)"""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows, k = rows.shape
    if x.dtype != torch.bfloat16 or packed.numel() != out_features * k:
        raise ValueError(f"amx matmul: x {tuple(x.shape)} {x.dtype} does not fit a packed "
                         f"weight of {out_features} x {packed.numel() // out_features}")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)
                             or bias.stride(0) != 1):
        raise ValueError(f"amx matmul: bias must be contiguous bf16 [{out_features}]")
    out = torch.empty(num_rows, out_features // 2 if gate_up else out_features,
                      dtype=torch.bfloat16)
    rc = _function("matmul_amx", torch.bfloat16)(
        rows.data_ptr(), rows.stride(0), num_rows, packed.data_ptr(),
        _ptr(bias), out_features, k, gate_up, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"amx matmul cannot run [{num_rows}, {k}] x [{out_features}, {k}]^T "
                           f"(error {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])


# -- a bf16 decoder layer's work around attention, in two calls (blocks.c) ----------------------
def layer_blocks_available() -> bool:
    """Whether `attention_input` and `attention_output_mlp` run here: the AMX matmul does."""
    return _amx_on and amx_available()


def attention_input(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, qkv_packed: torch.Tensor, qkv_bias: torch.Tensor | None,
                    positions: torch.Tensor, cos_sin: torch.Tensor, rotary_heads: int,
                    head_dim: int, h: torch.Tensor, qkv: torch.Tensor) -> None:
    """With residual: residual += x, h = RMSNorm(residual); else h = RMSNorm(x). Then
    qkv = h Wqkv^T (+ bias) with the first `rotary_heads` heads (q, then k) rotated at
    `positions` in place (as `rotary_`). x, residual, h [T, hidden]; qkv [T, n_qkv]; all
    contiguous bf16, the weight packed by `pack_amx_weight`, positions [T] int64. The checks
    are those the C code cannot make; the layer's fixed shapes are checked once, when the
    model decides to run its layers this way (LlamaDecoderLayer.blocks_ready)."""
    rows, hidden = x.shape
    n_qkv = qkv.shape[1]
    # The messages are formatted only on failure: these run for every layer of every step.
    if not (x.dtype == torch.bfloat16 and x.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))
            and h.shape == x.shape and qkv.shape[0] == rows
            and qkv_packed.numel() == n_qkv * hidden):
        raise ValueError(f"attention input: x {tuple(x.shape)} {x.dtype} does not fit h "
                         f"{tuple(h.shape)}, qkv {tuple(qkv.shape)} and a packed weight of "
                         f"{qkv_packed.numel()} values")
    if not (positions.dtype == torch.int64 and positions.shape == (rows,)
            and positions.is_contiguous() and cos_sin.shape[1:] == (2, head_dim)
            and rotary_heads * head_dim <= n_qkv):
        raise ValueError(f"attention input: positions {tuple(positions.shape)} "
                         f"{positions.dtype} for {rows} rows, a rotary table "
                         f"{tuple(cos_sin.shape)}, {rotary_heads} heads of {head_dim}")
    rc = _function("attention_input", torch.bfloat16)(
        x.data_ptr(), _ptr(residual), norm_weight.data_ptr(), eps, qkv_packed.data_ptr(),
        _ptr(qkv_bias), n_qkv, rows, hidden, positions.data_ptr(), cos_sin.data_ptr(),
        cos_sin.shape[0], rotary_heads, head_dim, h.data_ptr(), qkv.data_ptr())
    if rc == -10:
        raise _positions_outside(positions, cos_sin)
    if rc != 0:
        raise RuntimeError(f"attention input block cannot run [{rows}, {hidden}] -> {n_qkv} "
                           f"(error {rc})")


def attention_output_mlp(attn: torch.Tensor, o_packed: torch.Tensor, o_bias: torch.Tensor | None,
                         residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         gate_up_packed: torch.Tensor, gate_up_bias: torch.Tensor | None,
                         down_packed: torch.Tensor, down_bias: torch.Tensor | None,
                         h: torch.Tensor, act: torch.Tensor, out: torch.Tensor) -> None:
    """residual += attn Wo^T (+ bias); h = RMSNorm(residual);
    out = (SiLU(h Wg^T) * (h Wu^T)) Wd^T, biases added where given. attn [T, attn_width];
    residual, h, out [T, hidden]; act [T, intermediate] scratch; all contiguous bf16, weights
    packed by `pack_amx_weight` (gate/up with `gate_up`)."""
    rows, attn_width = attn.shape
    hidden, inter = out.shape[1], act.shape[1]
    if not (attn.dtype == torch.bfloat16 and attn.is_contiguous()
            and residual.shape == out.shape == h.shape == (rows, hidden)
            and residual.is_contiguous() and act.shape[0] == rows
            and o_packed.numel() == hidden * attn_width
            and gate_up_packed.numel() == 2 * inter * hidden
            and down_packed.numel() == hidden * inter):
        raise ValueError(f"attention output / MLP: attn {tuple(attn.shape)} {attn.dtype}, "
                         f"residual {tuple(residual.shape)}, out {tuple(out.shape)}, act "
                         f"{tuple(act.shape)} do not fit packed weights of {o_packed.numel()}, "
                         f"{gate_up_packed.numel()}, {down_packed.numel()} values")
    rc = _function("attention_output_mlp", torch.bfloat16)(
        attn.data_ptr(), attn_width, o_packed.data_ptr(), _ptr(o_bias), residual.data_ptr(),
        norm_weight.data_ptr(), eps, gate_up_packed.data_ptr(), _ptr(gate_up_bias),
        down_packed.data_ptr(), _ptr(down_bias), rows, hidden, inter, h.data_ptr(),
        act.data_ptr(), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"attention output / MLP block cannot run [{rows}, {attn_width}] -> "
                           f"{hidden}, intermediate {inter} (error {rc})")


# -- matmuls on GGUF block-quantized weights (matmul_gguf.c) -------------------------------------
def gguf_simd_available() -> bool:
    """Whether the GGUF matmul has its AVX-512 VNNI path here (built for a CPU with it)."""
    lib = load()
    return lib is not None and bool(lib.gguf_simd_available())


def set_gguf_simd(on: bool) -> None:
    """Use (default) or bypass the VNNI GGUF matmul, for comparing it with the plain C loop on
    one machine. Process-wide."""
    lib = load()
    if lib is not None:
        lib.set_gguf_simd(int(on))


def gguf_matmul(x: torch.Tensor, qtype: int, qs: torch.Tensor, d: torch.Tensor,
                m: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [rows, n] (rows at any stride, unit column stride) = x [rows, k] W^T (+ bias [n]), W
    in the layout of matmul_gguf.c (qs uint8, d and m fp16 [n, k / 32]); x, bias and out in one
    dtype, float32 or bfloat16; x's rows contiguous."""
    rows, k = x.shape
    n = d.shape[0]
    fn = _function("gguf_matmul", x.dtype)
    if fn is None:
        raise RuntimeError(f"gguf matmul is unavailable for {x.dtype}: "
                           f"{unavailable_reason() or 'dtype not supported'}")
    if not (x.stride(1) == 1 and out.dtype == x.dtype and out.shape == (rows, n)
            and out.stride(1) == 1 and (bias is None or (bias.dtype == x.dtype
                                                         and bias.shape == (n,)
                                                         and bias.is_contiguous()))):
        raise ValueError(f"gguf matmul: x {tuple(x.shape)} {x.dtype}, out {tuple(out.shape)} "
                         f"{out.dtype} do not fit a weight of {n} rows")
    rc = fn(x.data_ptr(), x.stride(0), rows, k, qtype, qs.data_ptr(), d.data_ptr(), _ptr(m), n,
            _ptr(bias), out.data_ptr(), out.stride(0))
    if rc != 0:
        raise RuntimeError(f"gguf matmul cannot run type {qtype}, [{rows}, {k}] x [{n}, {k}]^T "
                           f"(error {rc})")


def gguf_dequantize(qtype: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                    k: int, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The rows `ids` (int64; all rows when None) of a weight in matmul_gguf.c's layout,
    dequantized to `dtype` (float32 or bfloat16) exactly as gguf.quants.dequantize does (then
    rounded to bf16)."""
    n = d.shape[0]
    fn = _function("gguf_dequantize", dtype)
    if fn is None:
        raise RuntimeError(f"gguf dequantize is unavailable for {dtype}: "
                           f"{unavailable_reason() or 'dtype not supported'}")
    if ids is not None:
        ids = ids.contiguous()
    count = n if ids is None else ids.numel()
    out = torch.empty(count, k, dtype=dtype)
    rc = fn(qtype, qs.data_ptr(), d.data_ptr(), _ptr(m), n, k, _ptr(ids), count, out.data_ptr())
    if rc != 0:
        raise IndexError(f"gguf dequantize: type {qtype}, ids must lie in [0, {n})")
    return out


# -- int8 / w8a8 matmuls (matmul_int8.c) --------------------------------------------------------
INT8_PATHS = ("portable", "avx512", "vnni", "amx")  # matmul_int8.c's PATH_* 1..4
_int8_path = "auto"


def int8_paths(w8a8: bool) -> list[str]:
    """The int8 matmul paths this machine runs for one mode: "portable" wherever the kernels
    build; weight-only "avx512" (fp32 FMA on widened weights), "vnni" (activations in 24-bit
    fixed point, three byte planes) and "amx" (bf16 tiles, bf16 activations only); w8a8 "vnni"
    and "amx" (AMX-INT8); each where the CPU has it."""
    lib = load()
    if lib is None:
        return []
    mask = lib.matmul_int8_paths()
    usable = ("portable", "vnni", "amx") if w8a8 else INT8_PATHS
    return [p for i, p in enumerate(INT8_PATHS, 1) if mask >> i & 1 and p in usable]


def set_int8_path(path: str) -> None:
    """Run every int8 matmul on `path` (one of `int8_paths`) instead of choosing by rows
    ("auto", the default: AMX from 16 rows where it runs, the vector path below), for testing
    and comparing the paths on one machine. Process-wide."""
    global _int8_path
    if path != "auto" and path not in INT8_PATHS:
        raise ValueError(f"int8 path must be auto or one of {INT8_PATHS}, got {path!r}")
    _int8_path = path


def int8_kernels_available() -> bool:
    return load() is not None


def _int8_dims(n: int, k: int, gate_up: bool) -> tuple[int, int]:
    """(panels, K steps of 64) of a packed weight [n, k]."""
    panels = -(-(n // 2) // 16) if gate_up else -(-n // 32)
    return panels, -(-k // 64)


def pack_int8_weight(q: torch.Tensor, gate_up: bool = False,
                     empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = torch.empty,
                     ) -> torch.Tensor:
    """int8 q [N, K] -> the panel layout of matmul_int8.c (1-d int8, in memory from
    `empty(shape, dtype)`): K zero-padded to a multiple of 64, N to panels of 32 columns (with
    `gate_up`, q is [gate; up] and each half is padded to 16-column tiles)."""
    n, k = q.shape
    if gate_up and n % 2:
        raise ValueError(f"a gate_up weight needs an even number of rows, got {n}")
    panels, steps = _int8_dims(n, k, gate_up)
    kp = steps * 64
    if gate_up:  # [2 (gate, up), panels, 16 columns, K]
        half = n // 2
        w = torch.zeros(2, panels * 16, kp, dtype=torch.int8)
        w[:, :half, :k] = q.view(2, half, k)
        tiles = w.view(2, panels, 16, steps, 16, 4).permute(1, 3, 0, 4, 2, 5)
    else:  # [panels, 2 tiles, 16 columns, K]
        w = torch.zeros(panels * 32, kp, dtype=torch.int8)
        w[:n, :k] = q
        tiles = w.view(panels, 2, 16, steps, 16, 4).permute(0, 3, 1, 4, 2, 5)
    # -> [panel, step, tile, tile row r, column, 4 k]: k = 64 step + 4 r + j
    packed = empty((tiles.numel(),), dtype=torch.int8)
    packed.view(tiles.shape).copy_(tiles)
    return packed


def unpack_int8_weight(packed: torch.Tensor, n: int, k: int, gate_up: bool = False
                       ) -> torch.Tensor:
    """`pack_int8_weight`'s inverse: q [N, K] int8."""
    panels, steps = _int8_dims(n, k, gate_up)
    tiles = packed.view(panels, steps, 2, 16, 16, 4)
    if gate_up:
        w = tiles.permute(2, 0, 4, 1, 3, 5).reshape(2, panels * 16, steps * 64)
        return w[:, :n // 2, :k].reshape(n, k).contiguous()
    w = tiles.permute(0, 2, 4, 1, 3, 5).reshape(panels * 32, steps * 64)
    return w[:n, :k].contiguous()


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                weight_sums: torch.Tensor | None, bias: torch.Tensor | None, out_features: int,
                gate_up: bool = False, w8a8: bool = False, path: str | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16 or fp32) @ (q * scale[:, None])^T (+ bias) in x's dtype, q packed by
    `pack_int8_weight`, scale fp32 [N]: [..., out_features], or [..., out_features / 2] =
    SiLU(gate) * up for a `gate_up` weight. `w8a8` quantizes each row of x to int8 first (one
    scale per row). weight_sums = q.sum(1) int32 [N] is needed by the VNNI paths (w8a8 always;
    without it weight-only skips VNNI). `path` overrides
    `set_int8_path`; the result is written into `out` (contiguous, 2-d) when given."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows, k = rows.shape
    n = out_features
    panels, steps = _int8_dims(n, k, gate_up)
    if x.dtype not in _SUFFIX or packed.numel() != panels * steps * 2048:
        raise ValueError(f"int8 matmul: x {tuple(x.shape)} {x.dtype} does not fit a packed "
                         f"weight of {n} x {k}")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"int8 matmul: bias must be contiguous {x.dtype} [{n}]")
    assert scale.dtype == torch.float32 and scale.shape == (n,) and scale.is_contiguous()
    assert not w8a8 or (weight_sums is not None and weight_sums.dtype == torch.int32
                        and weight_sums.shape == (n,) and weight_sums.is_contiguous())
    fn = _function("matmul_int8", None)
    if fn is None:
        raise RuntimeError(f"int8 matmul is unavailable: {unavailable_reason()}")
    path = path or _int8_path
    shape = (num_rows, n // 2 if gate_up else n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype)
    elif not (out.shape == shape and out.dtype == x.dtype and out.is_contiguous()):
        raise ValueError(f"int8 matmul: out must be contiguous {shape} {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    rc = fn(rows.data_ptr(), rows.stride(0), num_rows, int(x.dtype == torch.bfloat16),
            packed.data_ptr(), scale.data_ptr(), _ptr(weight_sums), _ptr(bias), n, k,
            int(gate_up), int(w8a8), 0 if path == "auto" else INT8_PATHS.index(path) + 1,
            out.data_ptr())
    if rc == -2:
        raise RuntimeError(f"int8 matmul: path {path!r} does not run here for "
                           f"{'w8a8' if w8a8 else 'weight-only'} {x.dtype} "
                           f"(here: {int8_paths(w8a8)})")
    if rc != 0:
        raise RuntimeError(f"int8 matmul cannot run [{num_rows}, {k}] x [{n}, {k}]^T "
                           f"(error {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])
