"""glibc malloc settings for a process that runs the model on the CPU.

A decode step allocates and frees the same few hundred activation tensors (tens to hundreds of
KiB each) in every step. With glibc's defaults, a chunk above the mmap threshold (128 KiB at
first) is a fresh mmap, and the top of the heap goes back to the OS once 128 KiB of it is free,
so the same pages are faulted in and zeroed again step after step. Raising both keeps them in
the process: 2-4% more throughput on the benchmark workload (default model, bf16, measured in
alternating runs), for freed memory kept around: up to `trim_threshold` at the top of the heap
(plus `top_pad` on each growth), and freed chunks below it as glibc always keeps them.
"""
import ctypes

import structlog

log = structlog.get_logger("worker")

# mallopt(3) parameters.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 512 << 20,
                      top_pad: int = 64 << 20) -> bool:
    """Serve allocations up to `mmap_threshold` from the heap and keep up to `trim_threshold`
    of freed heap. -> whether the C library took the settings (glibc does; others lack
    mallopt and keep their own defaults)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: setting it also stops glibc moving it on its own.
    taken = [mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1,
             mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1,
             mallopt(M_TOP_PAD, top_pad) == 1]
    if not all(taken):
        log.warning("malloc settings not taken", mmap_threshold=taken[0], trim_threshold=taken[1],
                    top_pad=taken[2])
    return all(taken)
