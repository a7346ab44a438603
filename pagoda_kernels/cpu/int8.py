"""int8 weight-only and w8a8 matmuls (matmul_int8.c): the panel layout the weights are packed
into, its inverse, the paths this CPU runs, and the matmul itself."""
from collections.abc import Callable

import torch

from pagoda_kernels.cpu.bind import DTYPE_SUFFIX, bound_function, data_ptr
from pagoda_kernels.cpu.build import load, unavailable_reason

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
                in_features: int, gate_up: bool = False, w8a8: bool = False,
                path: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16 or fp32) @ (q * scale[:, None])^T (+ bias) in x's dtype, q [N, K] packed
    by `pack_int8_weight` (N = out_features, K = in_features), scale fp32 [N]:
    [..., out_features], or [..., out_features / 2] = SiLU(gate) * up for a `gate_up` weight.
    `w8a8` quantizes each row of x to int8 first (one scale per row). weight_sums = q.sum(1)
    int32 [N] is needed by the VNNI paths (w8a8 always; without it weight-only skips VNNI).
    `path` overrides `set_int8_path`; the result is written into `out` (contiguous, 2-d) when
    given. Raises ValueError, before anything is written, for tensors that do not fit."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows, k = rows.shape
    n = out_features
    panels, steps = _int8_dims(n, k, gate_up)
    # The packed size pins K only to its step of 64: x's K is checked against the weight's own.
    if (x.dtype not in DTYPE_SUFFIX or k != in_features or packed.dtype != torch.int8
            or not packed.is_contiguous() or packed.numel() != panels * steps * 2048):
        raise ValueError(f"int8 matmul: x {tuple(x.shape)} {x.dtype} does not fit a packed "
                         f"weight of {n} x {in_features} ({packed.numel()} {packed.dtype} "
                         f"values)")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"int8 matmul: bias must be contiguous {x.dtype} [{n}]")
    if not (scale.dtype == torch.float32 and scale.shape == (n,) and scale.is_contiguous()):
        raise ValueError(f"int8 matmul: scale must be contiguous float32 [{n}], got "
                         f"{tuple(scale.shape)} {scale.dtype}")
    if (weight_sums is None and w8a8) or (
            weight_sums is not None and not (weight_sums.dtype == torch.int32
                                             and weight_sums.shape == (n,)
                                             and weight_sums.is_contiguous())):
        raise ValueError(f"int8 matmul: weight_sums must be contiguous int32 [{n}]"
                         f"{' (w8a8 needs them)' if w8a8 else ''}")
    fn = bound_function("matmul_int8", None)
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
            packed.data_ptr(), scale.data_ptr(), data_ptr(weight_sums), data_ptr(bias), n, k,
            int(gate_up), int(w8a8), 0 if path == "auto" else INT8_PATHS.index(path) + 1,
            out.data_ptr())
    if rc == -2:
        raise RuntimeError(f"int8 matmul: path {path!r} does not run here for "
                           f"{'w8a8' if w8a8 else 'weight-only'} {x.dtype}, K = {k} "
                           f"(here: {int8_paths(w8a8)}; K limits in matmul_int8.c)")
    if rc != 0:
        raise RuntimeError(f"int8 matmul cannot run [{num_rows}, {k}] x [{n}, {k}]^T "
                           f"(error {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])
