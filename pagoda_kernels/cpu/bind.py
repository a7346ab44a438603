"""The compiled kernels' C functions with their ctypes signatures, bound once per name and dtype
(shared by the wrappers in pagoda_kernels/cpu/__init__.py, int8.py and gguf.py)."""
import ctypes

import torch

from pagoda_kernels.cpu.build import load

DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "paged_decode": ([_P, _I64, _P, _P, _P, _I64, _P, _P, _INT, _INT, _INT, _INT, _INT, _F], _INT),
    "causal_prefill": ([_P, _I64, _P, _I64, _P, _I64, _P, _INT, _I64, _INT, _INT, _INT, _F, _P],
                       _INT),
    "rms_norm": ([_P, _I64, _P, _P, _P, _I64, _INT, _F], None),
    "rotary": ([_P, _I64, _P, _P, _I64, _INT, _INT, _I64], _INT),
    "greedy_sample": ([_P, _I64, _I64, _I64, _P, _P], None),
    "race_sample": ([_P, _I64, _I64, _I64, _P, _P], _INT),
    "random_sample": ([_P, _I64, _I64, _I64, _P, _P, _P, _P, _P], _INT),
    "matmul_bf16_pack": ([_P, _I64, _I64, _INT, _P], _INT),
    "matmul_bf16": ([_P, _I64, _I64, _P, _P, _I64, _I64, _INT, _P], _INT),
    "matmul_f32_pack": ([_P, _I64, _I64, _INT, _P], _INT),
    "matmul_f32": ([_P, _I64, _I64, _P, _P, _I64, _I64, _INT, _P], _INT),
    "set_matmul_f32_rows": ([_INT], _INT),
    "matmul_f32_rows_choice": ([_INT], _INT),
    "matmul_int8": ([_P, _I64, _I64, _INT, _P, _P, _P, _P, _I64, _I64, _INT, _INT, _INT, _P],
                    _INT),
    "kv_cache_write": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64], _INT),
    "kv_cache_write_q8": ([_P, _I64, _P, _I64, _P, _P, _P, _I64, _INT, _INT, _INT, _INT, _I64],
                          _INT),
    "paged_decode_q8": ([_P, _I64, _P, _P, _P, _I64, _P, _P, _INT, _INT, _INT, _INT, _INT, _F,
                         _INT], _INT),
    "gguf_matmul": ([_P, _I64, _I64, _I64, _INT, _P, _P, _P, _I64, _P, _P, _I64], _INT),
    "gguf_dequantize": ([_INT, _P, _P, _P, _I64, _I64, _P, _I64, _P], _INT),
}
_bound: dict[tuple[str, torch.dtype | None], object] = {}


def bound_function(name: str, dtype: torch.dtype | None):
    """The C function `name` for dtype (its `_f32` / `_bf16` variant), or the one function of
    that name for dtype None; None where the kernels or that dtype are unavailable."""
    fn = _bound.get((name, dtype))
    if fn is None:
        lib = load()
        if lib is None or (dtype is not None and dtype not in DTYPE_SUFFIX):
            return None
        fn = getattr(lib, name if dtype is None else f"{name}_{DTYPE_SUFFIX[dtype]}")
        fn.argtypes, fn.restype = _SIGNATURES[name]
        _bound[(name, dtype)] = fn
    return fn


def data_ptr(t: torch.Tensor | None) -> int | None:
    """t's address, or None (a NULL pointer) for no tensor."""
    return None if t is None else t.data_ptr()
