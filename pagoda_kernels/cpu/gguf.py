"""Matmuls on GGUF block-quantized weights (matmul_gguf.c): Q8_0, Q4_0, Q4_1 and Q4_K in its panel
layout (filled by services/worker/models/gguf_weights.py), multiplied without a dequantized copy
or dequantized row by row. The C code trusts every shape it is given: the checks here are what keeps a
mismatched weight from reading past its arrays."""
import torch

from pagoda_kernels.cpu.bind import bound_function, data_ptr
from pagoda_kernels.cpu.build import load, unavailable_reason

_Q4_0, _Q4_1, _Q8_0, _Q4_K = 2, 3, 8, 12  # ggml's type ids
_TYPES = (_Q8_0, _Q4_0, _Q4_1, _Q4_K)


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


PANEL = 16  # weight rows per panel of the layout (matmul_gguf.c)


def panel_block_bytes(qtype: int) -> int:
    """Quant bytes of one block of 32 weights of a whole panel."""
    return 512 if qtype == _Q8_0 else 256


def scale_dtype(qtype: int) -> torch.dtype:
    """The dtype of a type's block scales (and mins) in the panel layout."""
    return torch.float32 if qtype == _Q4_K else torch.float16


def _check_blocks(what: str, qtype: int, qs: torch.Tensor, d: torch.Tensor,
                  m: torch.Tensor | None, n: int, k: int) -> None:
    """ValueError unless qs, d (and m for Q4_1 / Q4_K) are contiguous arrays of a weight [n, k]
    of `qtype` in matmul_gguf.c's panel layout: qs uint8 [panels, k / 32, panel block bytes], d
    (and m) [panels, k / 32, 16] of `scale_dtype`. (Runs for every matmul of a step: one pass of
    cheap tests, the message only on failure.)"""
    nb = k // 32
    panels = -(-n // PANEL)
    scales = (panels, nb, PANEL)
    has_min = qtype in (_Q4_1, _Q4_K)
    sd = scale_dtype(qtype)
    if (k > 0 and k % 32 == 0 and n >= 0 and qtype in _TYPES
            and d.shape == scales and d.dtype == sd and d.is_contiguous()
            and qs.dtype == torch.uint8 and qs.is_contiguous()
            and qs.shape == (panels, nb, panel_block_bytes(qtype))
            and (not has_min or (m is not None and m.shape == scales
                                 and m.dtype == sd and m.is_contiguous()))):
        return
    if qtype not in _TYPES or k <= 0 or k % 32:
        raise ValueError(f"{what}: type {qtype} with K = {k}: the kernel takes Q8_0 (8), Q4_0 "
                         f"(2), Q4_1 (3) and Q4_K (12) with K a multiple of 32")
    got = ", ".join(f"{name} {'None' if t is None else f'{tuple(t.shape)} {t.dtype}'}"
                    f"{'' if t is None or t.is_contiguous() else ' not contiguous'}"
                    for name, t in (("qs", qs), ("d", d), ("m", m)))
    kind = str(sd).removeprefix("torch.")
    raise ValueError(f"{what}: a type {qtype} weight [{n}, {k}] needs contiguous qs uint8 "
                     f"[{panels}, {nb}, {panel_block_bytes(qtype)}], d {kind} {list(scales)}"
                     f"{f', m {kind} {list(scales)}' if has_min else ''}; got {got}")


def gguf_matmul(x: torch.Tensor, qtype: int, qs: torch.Tensor, d: torch.Tensor,
                m: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [rows, n] (rows at any stride, unit column stride) = x [rows, k] W^T (+ bias [n]), W
    [n, k] in the panel layout of matmul_gguf.c (see `_check_blocks`); x, bias and out in one
    dtype, float32 or bfloat16; x's rows contiguous. Raises ValueError, before anything is
    written, for arrays that do not fit one another."""
    if x.dim() != 2 or out.dim() != 2:
        raise ValueError(f"gguf matmul: x and out must be 2-d, got {tuple(x.shape)} and "
                         f"{tuple(out.shape)}")
    rows, k = x.shape
    n = out.shape[1]
    _check_blocks("gguf matmul", qtype, qs, d, m, n, k)
    fn = bound_function("gguf_matmul", x.dtype)
    if fn is None:
        raise RuntimeError(f"gguf matmul is unavailable for {x.dtype}: "
                           f"{unavailable_reason() or 'dtype not supported'}")
    if not (x.stride(1) == 1 and out.dtype == x.dtype and out.shape == (rows, n)
            and out.stride(1) == 1 and (bias is None or (bias.dtype == x.dtype
                                                         and bias.shape == (n,)
                                                         and bias.is_contiguous()))):
        raise ValueError(f"gguf matmul: x {tuple(x.shape)} {x.dtype}, out {tuple(out.shape)} "
                         f"{out.dtype} do not fit a weight of {n} rows")
    rc = fn(x.data_ptr(), x.stride(0), rows, k, qtype, qs.data_ptr(), d.data_ptr(),
            data_ptr(m), n, data_ptr(bias), out.data_ptr(), out.stride(0))
    if rc != 0:
        raise RuntimeError(f"gguf matmul cannot run type {qtype}, [{rows}, {k}] x [{n}, {k}]^T "
                           f"(error {rc})")


def gguf_dequantize(qtype: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                    n: int, k: int, dtype: torch.dtype,
                    ids: torch.Tensor | None = None) -> torch.Tensor:
    """The rows `ids` (int64; all rows when None) of a weight [n, k] in matmul_gguf.c's layout,
    dequantized to `dtype` (float32 or bfloat16) exactly as gguf.quants.dequantize does (then
    rounded to bf16). Raises ValueError for arrays that do not fit one another or K, IndexError
    for an id outside the weight."""
    _check_blocks("gguf dequantize", qtype, qs, d, m, n, k)
    fn = bound_function("gguf_dequantize", dtype)
    if fn is None:
        raise RuntimeError(f"gguf dequantize is unavailable for {dtype}: "
                           f"{unavailable_reason() or 'dtype not supported'}")
    if ids is not None:
        if ids.dtype != torch.int64:
            raise ValueError(f"gguf dequantize: ids must be int64, got {ids.dtype}")
        ids = ids.contiguous()
    count = n if ids is None else ids.numel()
    out = torch.empty(count, k, dtype=dtype)
    rc = fn(qtype, qs.data_ptr(), d.data_ptr(), data_ptr(m), n, k, data_ptr(ids), count,
            out.data_ptr())
    if rc != 0:
        raise IndexError(f"gguf dequantize: type {qtype}, ids must lie in [0, {n})")
    return out
