"""The panel matmuls: y = x W^T (+ bias) with W packed once into panels of 32 output columns
that a matmul streams in memory order, for the layers and LM head of bf16 models
(matmul_bf16.c: AMX tiles or AVX512-BF16 dot products; matmul_bf16_avx2.c: bf16 widened to
fp32 for AVX2 FMA) and of fp32 models (matmul_f32.c: AVX-512 FMA; matmul_f32_avx2.c: AVX2
FMA). A gate/up weight packed with `gate_up` returns SiLU(gate) * up instead."""
from collections.abc import Callable

import torch

from pagoda_kernels.cpu.bind import bound_function as _function
from pagoda_kernels.cpu.bind import data_ptr as _ptr
from pagoda_kernels.cpu.build import load

_bf16_on = True
_f32_on = True


def set_bf16_matmul(on: bool) -> None:
    """Pack bf16 weights for the panel matmul where it runs (default), or leave them to oneDNN,
    for comparing the two on one machine. Applies to weights packed afterwards."""
    global _bf16_on
    _bf16_on = on


def set_f32_matmul(on: bool) -> None:
    """Let fp32 weights be packed into panels where the fp32 panel matmul runs (default), or
    not, for comparing it with oneDNN or MKL on one machine. Applies to weights packed
    afterwards."""
    global _f32_on
    _f32_on = on


def bf16_matmul_available() -> bool:
    """Whether the bf16 panel matmul runs here: built for a CPU with AVX512-BF16 (its AMX loop
    also needs AMX, granted by the OS), or for a CPU with AVX2 and FMA but no AVX-512."""
    lib = load()
    return lib is not None and lib.matmul_bf16_path() > 0


def f32_matmul_available() -> bool:
    """Whether the fp32 panel matmul runs here: built for a CPU with AVX-512, or AVX2 and FMA."""
    lib = load()
    return lib is not None and bool(lib.matmul_f32_available())


_BF16_PATHS = ("amx", "dot", "amx-stream")  # in the order of set_matmul_bf16_loop's choices
_BF16_AVX2_PATH = 3  # matmul_bf16_path()'s answer where the library has the AVX2 loop


def bf16_matmul_paths() -> list[str]:
    """The loops of the bf16 panel matmul this machine runs: "dot" (vdpbf16ps) wherever
    AVX512-BF16 runs it; where AMX is granted too, "amx" (K-blocked from 512 rows) and
    "amx-stream" (AMX's streaming loop at every batch size); "avx2" alone on CPUs with AVX2
    and FMA but no AVX-512."""
    lib = load()
    if lib is None or lib.matmul_bf16_path() == 0:
        return []
    if lib.matmul_bf16_path() == _BF16_AVX2_PATH:
        return ["avx2"]
    return ["dot"] + (["amx", "amx-stream"] if lib.matmul_amx_available() else [])


def set_bf16_matmul_path(path: str) -> None:
    """Run the bf16 panel matmul on `path` ("amx", the default, which is the dot loop where AMX
    does not run and the AVX2 loop without AVX-512; "dot"; "amx-stream"; or "avx2"
    where that is the loop), for checking and comparing the loops on one machine; takes effect
    at the next call."""
    if path == "avx2" or "avx2" in bf16_matmul_paths():
        if path == "amx" or path in bf16_matmul_paths():
            return  # the AVX2 loop, the only one there
        raise ValueError(f"the bf16 matmul runs {' and '.join(bf16_matmul_paths()) or 'no'} "
                         f"loop here, not {path!r}")
    if path not in _BF16_PATHS:
        raise ValueError(f"bf16 matmul path must be one of {', '.join(_BF16_PATHS)}, avx2; "
                         f"got {path!r}")
    lib = load()
    if lib is not None:
        lib.set_matmul_bf16_loop(_BF16_PATHS.index(path))


def f32_block_rows() -> tuple[int, ...]:
    """The heights the fp32 panel matmul's blocks can take here, lowest first, the last the
    one it runs until told otherwise (matmul_f32.c: 8 or 12 rows with AVX-512;
    matmul_f32_avx2.c: 4 or 6 with AVX2); none where it does not run."""
    choice = _function("matmul_f32_rows_choice", None)
    if choice is None or not f32_matmul_available():
        return ()
    return tuple(r for r in (choice(i) for i in range(2)) if r > 0)


_f32_rows: int | None = None  # the height set last; None: the C default, the tallest


def set_f32_block_rows(rows: int) -> None:
    """Run the fp32 panel matmul `rows` rows a block (one of `f32_block_rows()`: which is
    faster depends on the core's FMA units; `linear.fp32_layout` times each); takes effect at
    the next call. Raises ValueError for any other height, and so for every height where the
    panel matmul does not run."""
    global _f32_rows
    heights = f32_block_rows()
    if rows not in heights:
        raise ValueError(f"fp32 matmul block rows must be one of {heights}, got {rows!r}")
    _function("set_matmul_f32_rows", None)(rows)
    _f32_rows = rows


def f32_block_rows_now() -> int | None:
    """The height the fp32 panel matmul runs now; None where it does not run."""
    heights = f32_block_rows()
    return (_f32_rows or heights[-1]) if heights else None


# By weight dtype: the C prefix, and whether its panels may be packed and run here.
_KERNELS = {torch.bfloat16: ("matmul_bf16", lambda: _bf16_on and bf16_matmul_available()),
            torch.float32: ("matmul_f32", lambda: _f32_on and f32_matmul_available())}


def _pack(weight: torch.Tensor, dtype: torch.dtype, gate_up: bool,
          empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> torch.Tensor | None:
    if (weight.device.type != "cpu" or weight.dtype != dtype or weight.dim() != 2
            or not _KERNELS[dtype][1]()):
        return None
    n, k = weight.shape
    if n % 32 or (dtype == torch.bfloat16 and k % 32):  # (bf16 panels step K in pairs of 16)
        return None
    weight = weight.detach().contiguous()
    packed = empty((n * k,), dtype=dtype)
    rc = _function(_KERNELS[dtype][0] + "_pack", None)(weight.data_ptr(), n, k, int(gate_up),
                                                       packed.data_ptr())
    assert rc == 0, rc
    return packed


def pack_bf16_weight(weight: torch.Tensor, gate_up: bool = False,
                     empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = torch.empty,
                     ) -> torch.Tensor | None:
    """A bf16 weight [N, K] on the CPU rearranged for `bf16_linear` (same size, in memory from
    `empty(shape, dtype)`), or None where that does not run: neither AVX512-BF16 nor AVX2 and
    FMA, another dtype or device, N or K not a multiple of 32. With `gate_up` the weight is [gate; up] and the matmul
    returns SiLU(gate) * up."""
    return _pack(weight, torch.bfloat16, gate_up, empty)


def pack_f32_weight(weight: torch.Tensor, gate_up: bool = False,
                    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = torch.empty,
                    ) -> torch.Tensor | None:
    """An fp32 weight [N, K] on the CPU rearranged for `f32_linear` (same size, in memory from
    `empty(shape, dtype)`), or None where that does not run: neither AVX-512 nor AVX2 and FMA,
    another dtype or device, N not a multiple of 32 (any K). With `gate_up`, as
    `pack_bf16_weight`."""
    return _pack(weight, torch.float32, gate_up, empty)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
            out_features: int, gate_up: bool) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias), W panels of x's dtype. (Called ~200 times a decode step: the
    checks are the ones the C code cannot make.)"""
    dtype = packed.dtype
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows, k = rows.shape
    if x.dtype != dtype or packed.numel() != out_features * k:
        raise ValueError(f"{name} matmul: x {tuple(x.shape)} {x.dtype} does not fit a packed "
                         f"weight of {out_features} x {packed.numel() // out_features}")
    if bias is not None and (bias.dtype != dtype or bias.shape != (out_features,)
                             or bias.stride(0) != 1):
        raise ValueError(f"{name} matmul: bias must be contiguous {name} [{out_features}]")
    out = torch.empty(num_rows, out_features // 2 if gate_up else out_features, dtype=dtype)
    rc = _function(_KERNELS[dtype][0], None)(
        rows.data_ptr(), rows.stride(0), num_rows, packed.data_ptr(),
        _ptr(bias), out_features, k, gate_up, out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"{name} matmul cannot run [{num_rows}, {k}] x [{out_features}, {k}]^T "
                           f"(error {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int, gate_up: bool = False) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias) with W packed by `pack_bf16_weight`: [..., out_features],
    or [..., out_features / 2] = SiLU(gate) * up for a `gate_up` weight."""
    if packed.dtype != torch.bfloat16:
        raise ValueError(f"bf16 matmul: the packed weight is {packed.dtype}")
    return _linear(x, packed, bias, out_features, gate_up)


def f32_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int, gate_up: bool = False) -> torch.Tensor:
    """As `bf16_linear`, fp32, with W packed by `pack_f32_weight`."""
    if packed.dtype != torch.float32:
        raise ValueError(f"fp32 matmul: the packed weight is {packed.dtype}")
    return _linear(x, packed, bias, out_features, gate_up)
