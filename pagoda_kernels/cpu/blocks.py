"""The layer blocks of blocks.c: a decoder layer's work before attention and after it in one C
call each, and a whole decode step's layers (attention included) in one, for bf16 or fp32
activations and any weight the CPU matmuls take (bf16 or fp32 panels, int8 / w8a8 panels, GGUF
panels).

Each matmul weight is described once, after loading, by a `BlockLinear` (`bf16_block_linear`,
`f32_block_linear`, `int8_block_linear`, `gguf_block_linear`): its arrays' addresses and
shapes, checked here when it is built, since the C code trusts them. Each call checks only what changes per step: the
activations' shapes, dtypes and layout."""
import ctypes
from dataclasses import dataclass

import torch

from pagoda_kernels.cpu.bind import DTYPE_SUFFIX
from pagoda_kernels.cpu.build import load, unavailable_reason
from pagoda_kernels.cpu.gguf import _check_blocks
from pagoda_kernels.cpu.int8 import _int8_dims
from pagoda_kernels.reference import cache_row_width

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
MAX_PARTS = 4  # blocks.c
_BF16, _INT8, _W8A8, _GGUF, _F32 = 1, 2, 3, 4, 5
# 8-bit KV cache formats by their codes in pagoda_kernels/cpu/kv_quant.h.
Q8_CACHE_CODES = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


class LinearDesc(ctypes.Structure):
    """blocks.c's linear_t."""
    _fields_ = [("kind", _I64), ("n", _I64), ("k", _I64), ("gate_up", _I64), ("data", _P),
                ("scale", _P), ("sums", _P), ("bias", _P), ("parts", _I64),
                ("qtype", _I64 * MAX_PARTS), ("row0", _I64 * MAX_PARTS),
                ("rows", _I64 * MAX_PARTS), ("qs", _P * MAX_PARTS), ("d", _P * MAX_PARTS),
                ("m", _P * MAX_PARTS)]


class DecodeLayerDesc(ctypes.Structure):
    """blocks.c's decode_layer_t."""
    _fields_ = [("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc),
                ("down", LinearDesc), ("norm1", _P), ("norm2", _P), ("k_cache", _P),
                ("v_cache", _P)]


class DecodeModelDesc(ctypes.Structure):
    """blocks.c's decode_model_t."""
    _fields_ = [("hidden", _I64), ("inter", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("head_dim", _I64), ("block_size", _I64), ("num_slots", _I64),
                ("max_positions", _I64), ("cache_dtype", _I64), ("cos_sin", _P), ("eps", _F),
                ("scale", _F)]


@dataclass
class BlockLinear:
    """A matmul weight [n, k] as blocks.c runs it, for activations of `dtype`: `outputs`
    columns (n, or n / 2 for a gate/up weight with SiLU(gate) * up in the kernel)."""
    desc: LinearDesc
    n: int
    k: int
    dtype: torch.dtype
    outputs: int
    tensors: tuple  # what desc points into, kept alive with it


_bound: dict[str, object] = {}
_SIGNATURES = {
    "attention_input": ([_P, _P, _P, _P, _F, _I64, _I64, _P, _P, _I64, _INT, _INT, _P, _P, _INT],
                        _INT),
    "attention_output_mlp": ([_P, _P, _P, _P, _I64, _P, _P, _F, _I64, _I64, _I64, _P, _P, _P,
                              _P, _INT], _INT),
    "silu_mul_rows": ([_P, _I64, _I64, _P, _INT], None),
    "decode_layers": ([_P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _P, _P, _P, _P, _P,
                       _P, _P, _INT], _INT),
}


def _function(name: str):
    fn = _bound.get(name)
    if fn is None:
        lib = load()
        if lib is None:
            raise RuntimeError(f"the layer blocks are unavailable: {unavailable_reason()}")
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _SIGNATURES[name]
        _bound[name] = fn
    return fn


def layer_blocks_available() -> bool:
    return load() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_bias(what: str, bias: torch.Tensor | None, n: int, dtype: torch.dtype) -> None:
    if bias is not None and not (bias.dtype == dtype and bias.shape == (n,)
                                 and bias.is_contiguous()):
        raise ValueError(f"{what}: bias must be contiguous {dtype} [{n}], got "
                         f"{tuple(bias.shape)} {bias.dtype}")


def _linear(kind: int, n: int, k: int, dtype: torch.dtype, gate_up: bool,
            bias: torch.Tensor | None, tensors: tuple, **fields) -> BlockLinear:
    if dtype not in DTYPE_SUFFIX:
        raise ValueError(f"layer blocks run bf16 or fp32 activations, not {dtype}")
    desc = LinearDesc(kind=kind, n=n, k=k, gate_up=int(gate_up), bias=_ptr(bias), **fields)
    return BlockLinear(desc, n, k, dtype, n // 2 if gate_up else n, (*tensors, bias))


def _panel_block_linear(kind: int, dtype: torch.dtype, packed: torch.Tensor, n: int, k: int,
                        bias: torch.Tensor | None, gate_up: bool) -> BlockLinear:
    what = f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} block weight"
    if packed.dtype != dtype or packed.numel() != n * k or not packed.is_contiguous():
        raise ValueError(f"{what}: {packed.numel()} {packed.dtype} values for [{n}, {k}]")
    if n % 32 or (dtype == torch.bfloat16 and k % 32):  # what the panels take (panels.py)
        raise ValueError(f"{what}: [{n}, {k}] is not a whole number of panels")
    _check_bias(what, bias, n, dtype)
    return _linear(kind, n, k, dtype, gate_up, bias, (packed,), data=packed.data_ptr())


def bf16_block_linear(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
                      gate_up: bool = False) -> BlockLinear:
    """A bf16 weight [n, k] packed by `pack_bf16_weight` (bf16 activations only)."""
    return _panel_block_linear(_BF16, torch.bfloat16, packed, n, k, bias, gate_up)


def f32_block_linear(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
                     gate_up: bool = False) -> BlockLinear:
    """An fp32 weight [n, k] packed by `pack_f32_weight` (fp32 activations only)."""
    return _panel_block_linear(_F32, torch.float32, packed, n, k, bias, gate_up)


def int8_block_linear(packed: torch.Tensor, scale: torch.Tensor, sums: torch.Tensor | None,
                      n: int, k: int, bias: torch.Tensor | None, dtype: torch.dtype,
                      gate_up: bool = False, w8a8: bool = False) -> BlockLinear:
    """A weight [n, k] packed by `pack_int8_weight` with its fp32 scales and int32 row sums."""
    panels, steps = _int8_dims(n, k, gate_up)
    if (packed.dtype != torch.int8 or packed.numel() != panels * steps * 2048
            or not packed.is_contiguous()
            or not (scale.dtype == torch.float32 and scale.shape == (n,) and scale.is_contiguous())
            or (sums is None and w8a8)
            or (sums is not None and not (sums.dtype == torch.int32 and sums.shape == (n,)
                                          and sums.is_contiguous()))):
        raise ValueError(f"int8 block weight: packed {packed.numel()} {packed.dtype}, scale "
                         f"{tuple(scale.shape)} {scale.dtype}, sums "
                         f"{None if sums is None else (tuple(sums.shape), sums.dtype)} do not "
                         f"fit [{n}, {k}]")
    _check_bias("int8 block weight", bias, n, dtype)
    return _linear(_W8A8 if w8a8 else _INT8, n, k, dtype, gate_up, bias, (packed, scale, sums),
                   data=packed.data_ptr(), scale=scale.data_ptr(), sums=_ptr(sums))


def gguf_block_linear(parts: list, n: int, k: int, bias: torch.Tensor | None,
                      dtype: torch.dtype) -> BlockLinear:
    """A GGUF weight [n, k] as parts (qtype, row0, rows, qs, d, m) in matmul_gguf.c's panel
    layout, covering its rows in order."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"gguf block weight: 1 to {MAX_PARTS} parts, got {len(parts)}")
    row = 0
    for qtype, row0, rows, qs, d, m in parts:
        if row0 != row:
            raise ValueError(f"gguf block weight: a part starts at row {row0}, not {row}")
        _check_blocks("gguf block weight", qtype, qs, d, m, rows, k)
        row += rows
    if row != n:
        raise ValueError(f"gguf block weight: parts cover {row} rows of {n}")
    _check_bias("gguf block weight", bias, n, dtype)
    pad = [0] * (MAX_PARTS - len(parts))
    column = list(zip(*parts))
    return _linear(_GGUF, n, k, dtype, False, bias, tuple(t for p in parts for t in p[3:]),
                   parts=len(parts), qtype=(_I64 * MAX_PARTS)(*column[0], *pad),
                   row0=(_I64 * MAX_PARTS)(*column[1], *pad),
                   rows=(_I64 * MAX_PARTS)(*column[2], *pad),
                   qs=(_P * MAX_PARTS)(*[t.data_ptr() for t in column[3]], *pad),
                   d=(_P * MAX_PARTS)(*[t.data_ptr() for t in column[4]], *pad),
                   m=(_P * MAX_PARTS)(*[_ptr(t) for t in column[5]], *pad))


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2 I] ([gate | up] per row, rows contiguous, bf16 or fp32) -> SiLU(gate) * up
    [T, I], as the blocks compute it for a gate/up weight that does not fuse it."""
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.dtype not in DTYPE_SUFFIX:
        raise ValueError(f"silu_mul: gu must be [T, 2 I] bf16 or fp32, got {tuple(gu.shape)} "
                         f"{gu.dtype}")
    if not gu.is_contiguous():
        gu = gu.contiguous()
    rows, inter = gu.shape[0], gu.shape[1] // 2
    act = torch.empty(rows, inter, dtype=gu.dtype)
    _function("silu_mul_rows")(gu.data_ptr(), rows, inter, act.data_ptr(),
                               int(gu.dtype == torch.bfloat16))
    return act


def _rows_of(what: str, t: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> None:
    if not (t.shape == (rows, cols) and t.dtype == dtype and t.is_contiguous()):
        raise ValueError(f"{what}: must be contiguous {dtype} [{rows}, {cols}], got "
                         f"{tuple(t.shape)} {t.dtype}")


def attention_input(qkv_w: BlockLinear, x: torch.Tensor, residual: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                    cos_sin: torch.Tensor, rotary_heads: int, head_dim: int, h: torch.Tensor,
                    qkv: torch.Tensor) -> None:
    """With residual: residual += x, h = RMSNorm(residual); else h = RMSNorm(x). Then
    qkv = h Wqkv^T (+ bias), its first `rotary_heads` heads (q, then k) rotated at `positions`
    in place (as `rotary_`). x, residual, h [T, hidden]; qkv [T, n_qkv]; contiguous, in the
    weight's activation dtype; positions [T] int64."""
    rows, hidden = x.shape
    dtype = qkv_w.dtype
    if not (qkv_w.k == hidden and not qkv_w.desc.gate_up and norm_weight.shape == (hidden,)
            and norm_weight.dtype == dtype and norm_weight.is_contiguous()
            and positions.dtype == torch.int64 and positions.shape == (rows,)
            and positions.is_contiguous() and cos_sin.dtype == dtype
            and cos_sin.shape[1:] == (2, head_dim) and cos_sin.is_contiguous()
            and rotary_heads * head_dim <= qkv_w.n):
        raise ValueError(f"attention input: x {tuple(x.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}, positions {tuple(positions.shape)} "
                         f"{positions.dtype}, rotary table {tuple(cos_sin.shape)} "
                         f"{cos_sin.dtype} and {rotary_heads} heads of {head_dim} do not fit "
                         f"a qkv weight [{qkv_w.n}, {qkv_w.k}] for {dtype}")
    for what, t in (("x", x), ("residual", residual), ("h", h)):
        if t is not None:
            _rows_of(f"attention input: {what}", t, rows, hidden, dtype)
    _rows_of("attention input: qkv", qkv, rows, qkv_w.outputs, dtype)
    rc = _function("attention_input")(
        ctypes.byref(qkv_w.desc), x.data_ptr(), _ptr(residual), norm_weight.data_ptr(), eps,
        rows, hidden, positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0],
        rotary_heads, head_dim, h.data_ptr(), qkv.data_ptr(), int(dtype == torch.bfloat16))
    if rc == -10:
        raise IndexError(f"rotary positions must lie in [0, {cos_sin.shape[0]}), got "
                         f"{positions.min().item()}..{positions.max().item()}")
    if rc != 0:
        raise RuntimeError(f"attention input block cannot run [{rows}, {hidden}] -> "
                           f"{qkv_w.n} (error {rc})")


def attention_output_mlp(o_w: BlockLinear, gate_up_w: BlockLinear, down_w: BlockLinear,
                         attn: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float, h: torch.Tensor, gu: torch.Tensor | None,
                         act: torch.Tensor, out: torch.Tensor) -> None:
    """residual += attn Wo^T (+ bias); h = RMSNorm(residual);
    out = (SiLU(h Wg^T) * (h Wu^T)) Wd^T, biases added where given. attn [T, attn_width];
    residual, h, out [T, hidden]; act [T, intermediate]; gu [T, 2 intermediate] scratch, needed
    when the gate/up weight does not fuse SiLU * up; contiguous, in the weights' dtype."""
    rows, width = attn.shape
    hidden, inter = o_w.n, down_w.k
    dtype = o_w.dtype
    if not (o_w.k == width and gate_up_w.k == hidden and gate_up_w.n == 2 * inter
            and down_w.n == hidden and gate_up_w.dtype == down_w.dtype == dtype
            and not o_w.desc.gate_up and not down_w.desc.gate_up
            and norm_weight.shape == (hidden,) and norm_weight.dtype == dtype
            and norm_weight.is_contiguous()):
        raise ValueError(f"attention output / MLP: attn {tuple(attn.shape)} and weights "
                         f"o [{o_w.n}, {o_w.k}], gate/up [{gate_up_w.n}, {gate_up_w.k}], down "
                         f"[{down_w.n}, {down_w.k}] ({dtype}) do not fit")
    _rows_of("attention output / MLP: attn", attn, rows, width, dtype)
    for what, t in (("residual", residual), ("h", h), ("out", out)):
        _rows_of(f"attention output / MLP: {what}", t, rows, hidden, dtype)
    _rows_of("attention output / MLP: act", act, rows, inter, dtype)
    if not gate_up_w.desc.gate_up:
        if gu is None:
            raise ValueError("attention output / MLP: this gate/up weight needs the gu scratch")
        _rows_of("attention output / MLP: gu", gu, rows, 2 * inter, dtype)
    rc = _function("attention_output_mlp")(
        ctypes.byref(o_w.desc), ctypes.byref(gate_up_w.desc), ctypes.byref(down_w.desc),
        attn.data_ptr(), width, residual.data_ptr(), norm_weight.data_ptr(), eps, rows, hidden,
        inter, h.data_ptr(), _ptr(gu), act.data_ptr(), out.data_ptr(),
        int(dtype == torch.bfloat16))
    if rc != 0:
        raise RuntimeError(f"attention output / MLP block cannot run [{rows}, {width}] -> "
                           f"{hidden}, intermediate {inter} (error {rc})")


@dataclass
class DecodeStepWeights:
    """Every layer's weights and KV cache as `decode_layers` takes them (`decode_weights`)."""
    layers: ctypes.Array
    model: DecodeModelDesc
    final_norm: torch.Tensor
    dtype: torch.dtype
    fused_gate_up: bool
    keep: tuple


def decode_weights(layers: list[tuple[BlockLinear, BlockLinear, BlockLinear, BlockLinear,
                                      torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                   final_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                   head_dim: int, cos_sin: torch.Tensor, scale: float) -> DecodeStepWeights:
    """Per layer (qkv, o, gate_up, down, norm1, norm2, k_cache, v_cache), the caches
    [blocks, block_size, kv_heads, row] in the activation dtype or an 8-bit format
    (pagoda_kernels/reference.py: cache_row_width), checked once here."""
    if not layers:
        raise ValueError("decode layers: no layers")
    first = layers[0]
    dtype, hidden, inter = first[0].dtype, first[1].n, first[3].k
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    k_cache = first[6]
    cache_dtype = k_cache.dtype
    cache_code = -1 if cache_dtype == dtype else Q8_CACHE_CODES.get(cache_dtype)
    if cache_code is None:
        raise ValueError(f"decode layers: a {cache_dtype} cache for {dtype} activations")
    for qkv, o, gate_up, down, norm1, norm2, kc, vc in layers:
        if not (qkv.n == q_size + 2 * kv_size and qkv.k == hidden and o.k == q_size
                and o.n == hidden and gate_up.n == 2 * inter and gate_up.k == hidden
                and down.n == hidden and down.k == inter
                and all(w.dtype == dtype for w in (qkv, o, gate_up, down))
                and not (qkv.desc.gate_up or o.desc.gate_up or down.desc.gate_up)
                and bool(gate_up.desc.gate_up) == bool(first[2].desc.gate_up)
                and all(t.shape == (hidden,) and t.dtype == dtype and t.is_contiguous()
                        for t in (norm1, norm2))
                and all(c.shape == k_cache.shape and c.dtype == cache_dtype
                        and c.is_contiguous() for c in (kc, vc))
                and k_cache.shape[2:] == (kv_heads, cache_row_width(cache_dtype, head_dim))):
            raise ValueError("decode layers: the layers' weights, norms and caches do not fit "
                             "one another")
    if not (final_norm.shape == (hidden,) and final_norm.dtype == dtype
            and final_norm.is_contiguous()
            and cos_sin.dtype == dtype and cos_sin.shape[1:] == (2, head_dim)
            and cos_sin.is_contiguous() and k_cache.shape[1] <= 128 and head_dim <= 256
            and heads % kv_heads == 0 and heads // kv_heads <= 16):
        raise ValueError("decode layers: the final norm, rotary table or attention shapes do "
                         "not fit the paged decode kernel")
    descs = (DecodeLayerDesc * len(layers))()
    for i, (qkv, o, gate_up, down, norm1, norm2, kc, vc) in enumerate(layers):
        descs[i] = DecodeLayerDesc(qkv.desc, o.desc, gate_up.desc, down.desc, norm1.data_ptr(),
                                   norm2.data_ptr(), kc.data_ptr(), vc.data_ptr())
    model = DecodeModelDesc(hidden=hidden, inter=inter, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, block_size=k_cache.shape[1],
                            num_slots=k_cache.shape[0] * k_cache.shape[1],
                            max_positions=cos_sin.shape[0], cache_dtype=cache_code,
                            cos_sin=cos_sin.data_ptr(), eps=eps, scale=scale)
    return DecodeStepWeights(descs, model, final_norm, dtype, bool(first[2].desc.gate_up),
                             (layers, cos_sin))


def decode_layers(weights: DecodeStepWeights, x: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  out: torch.Tensor) -> None:
    """A decode step through every layer and the final norm: x [T, hidden] the embedded new
    tokens of T sequences (overwritten: it carries the residual stream), positions, slots
    (cache slot of each new token) and seq_lens [T] int64, block_tables [T, *] int64; the
    normalised hidden states into out [T, hidden]."""
    md = weights.model
    rows, hidden = x.shape
    dtype = weights.dtype
    _rows_of("decode layers: x", x, rows, md.hidden, dtype)
    _rows_of("decode layers: out", out, rows, md.hidden, dtype)
    for what, t in (("positions", positions), ("slots", slots), ("seq_lens", seq_lens)):
        if not (t.dtype == torch.int64 and t.shape == (rows,) and t.is_contiguous()):
            raise ValueError(f"decode layers: {what} must be contiguous int64 [{rows}]")
    if not (block_tables.dtype == torch.int64 and block_tables.dim() == 2
            and block_tables.shape[0] == rows and block_tables.stride(1) == 1):
        raise ValueError(f"decode layers: block_tables must be int64 [{rows}, *] with "
                         f"contiguous rows")
    # The kernel indexes blocks by the tables and the rotary table by positions unchecked.
    num_blocks = md.num_slots // md.block_size
    if rows and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks
                 or int(seq_lens.min()) < 1
                 or int(seq_lens.max()) > block_tables.shape[1] * md.block_size):
        raise ValueError("decode layers: block tables or sequence lengths outside the cache")
    q_size = md.heads * md.head_dim
    n_qkv = q_size + 2 * md.kv_heads * md.head_dim

    def empty(cols):
        return torch.empty(rows, cols, dtype=dtype)
    # Workspace shared by the layers in turn (held here for the call).
    h, qkv, attn, act, mlp_out = (empty(hidden), empty(n_qkv), empty(q_size), empty(md.inter),
                                  empty(hidden))
    gu = None if weights.fused_gate_up else empty(2 * md.inter)
    rc = _function("decode_layers")(
        weights.layers, len(weights.layers), ctypes.byref(md), weights.final_norm.data_ptr(),
        x.data_ptr(), positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), rows, h.data_ptr(), qkv.data_ptr(),
        attn.data_ptr(), _ptr(gu), act.data_ptr(), mlp_out.data_ptr(), out.data_ptr(),
        int(dtype == torch.bfloat16))
    if rc != 0:
        layer, error = divmod(-rc, 1000)
        if error == 10:
            raise IndexError(f"rotary positions must lie in [0, {md.max_positions}), got "
                             f"{positions.min().item()}..{positions.max().item()}")
        if error == 30:
            raise IndexError(f"kv cache slots must lie in [0, {md.num_slots})")
        if error == 32:
            raise ValueError(f"decode layers: no 8-bit cache format {md.cache_dtype}")
        raise RuntimeError(f"decode layers: layer {layer - 1} failed (error {-error})")
