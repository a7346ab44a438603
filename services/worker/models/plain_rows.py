"""How many rows a step's matmuls would have without speculation, so that quantized matmuls
take the same path with it.

GGUF and int8 matmuls pick their kernel by the rows of x: GGUF's 8-bit-activation kernel up
to `gguf_weights.KERNEL_MAX_ROWS` rows, a dequantized temporary above; int8's vector paths
under 16 rows, AMX from 16 where it runs (AMX_MIN_ROWS in pagoda_kernels/cpu/matmul_int8.c). The paths
round differently. A verifying step computes 1 + k rows for each speculating sequence where
plain decoding computes one, so it could cross a threshold the plain step stays under. The
model runner sets `plain_step_rows` around its passes; a quantized matmul whose plain step
stays under its threshold then runs in pieces of at most that many rows, on the same path.
Rows of these kernels do not depend on each other (each is quantized and reduced alone), so
the pieces give each row what a plain step gives it. (Not covered: int8 weight-only on AVX-512
without VNNI, whose loop changes at 4 rows too.)
"""
from contextlib import contextmanager

import torch

from pagoda_kernels import cpu as cpu_kernels
from services.worker.models.gguf_weights import KERNEL_MAX_ROWS

INT8_VECTOR_MAX_ROWS = 15  # int8's vector paths, below AMX_MIN_ROWS (16) of matmul_int8.c

_plain_rows: int | None = None  # None: the step is plain (no proposals)


@contextmanager
def plain_step_rows(num_rows: int | None):
    """Within: matmuls run as in a step of `num_rows` rows (None: as they come)."""
    global _plain_rows
    before, _plain_rows = _plain_rows, num_rows
    try:
        yield
    finally:
        _plain_rows = before


def max_rows(kind: str, x: torch.Tensor) -> int | None:
    """The rows per call that keep a `kind` matmul on the plain step's path; None: any."""
    n = _plain_rows
    if n is None or not cpu_kernels.available_for(x):
        return None
    limit = KERNEL_MAX_ROWS.get(x.dtype, -1) if kind == "gguf" else INT8_VECTOR_MAX_ROWS
    return limit if 0 < n <= limit else None


def in_pieces(fn, x: torch.Tensor, limit: int | None, *args) -> torch.Tensor:
    """fn(x, *args) over the rows of x in pieces of at most `limit` (None: in one call)."""
    if limit is None:
        return fn(x, *args)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= limit:
        return fn(x, *args)
    out = torch.cat([fn(rows[i:i + limit], *args) for i in range(0, rows.shape[0], limit)])
    return out.view(*x.shape[:-1], out.shape[-1])
