"""Host memory for a process that runs the model on the CPU: glibc's malloc settings for the
activations, and huge pages for what every step streams through (weights, KV caches).

A decode step allocates and frees the same few hundred activation tensors (tens to hundreds of
KiB each) in every step. With glibc's defaults, a chunk above the mmap threshold (128 KiB at
first) is a fresh mmap, and the top of the heap goes back to the OS once 128 KiB of it is free,
so the same pages are faulted in and zeroed again step after step. Raising both keeps them in
the process: 2-4% more throughput on the benchmark workload (default model, bf16, measured in
alternating runs), for freed memory kept around: up to `trim_threshold` at the top of the heap
(plus `top_pad` on each growth), and freed chunks below it as glibc always keeps them.
"""
import ctypes
import math
import mmap
import threading

import structlog
import torch

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


# -- transparent huge pages ----------------------------------------------------------------------
def _huge_page_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _huge_page_size()  # 2 MiB on x86-64
_PAGE = mmap.PAGESIZE


class HugePageArena:
    """Tensors carved from large anonymous mappings advised for transparent huge pages.

    A decode step streams every weight and the whole live KV cache from memory. On 4 KiB pages
    that stream crosses a page every 4 KiB, and the CPU's prefetchers stop at each crossing (and
    each needs a TLB walk): measured here, the default model's 30 layers of bf16 matmuls at batch
    64 read their weights at ~6 GB/s from 4 KiB pages and ~10 GB/s from 2 MiB pages. Linux
    backs an anonymous mapping with huge pages only where it is advised to (the usual
    `transparent_hugepage=madvise` setting), and torch's allocator does not advise it.

    Tensors up to half a chunk are packed one after another (page-aligned), so that small ones
    share huge pages instead of each rounding up to 2 MiB; larger ones (a layer's KV cache) get a
    mapping each. A mapping is freed when the last tensor in it is, and the arena no longer
    fills it. Where the kernel has no transparent huge pages the mappings are plain memory.
    (With the kernel's default `defrag=madvise`, a fault in an advised range may compact memory
    to find a huge page: slower start-up on a fragmented host, never a failure.)
    """

    def __init__(self, chunk_bytes: int = 64 << 20):
        self.chunk_bytes = chunk_bytes
        self._free: torch.Tensor | None = None  # uint8, the rest of the current mapping
        self._lock = threading.Lock()
        self.advised = True

    def _map(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError, ValueError) as e:
            if self.advised:
                log.info("transparent huge pages not available", error=str(e))
            self.advised = False
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        start = -whole.data_ptr() % HUGE_PAGE
        return whole[start:start + size - HUGE_PAGE]

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor whose memory starts on a page boundary."""
        nbytes = math.prod(shape) * dtype.itemsize
        padded = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        with self._lock:
            if 2 * padded > self.chunk_bytes:  # a large one gets a mapping of its own, so
                # that it leaves no unused tail behind in the current one
                block = self._map(padded)
            else:
                if self._free is None or self._free.numel() < padded:
                    self._free = self._map(self.chunk_bytes)
                block, self._free = self._free[:padded], self._free[padded:]
        return block[:nbytes].view(dtype).view(shape)


_arena = HugePageArena()
_huge_pages_on = True


def use_huge_pages(on: bool) -> None:
    """Place weights and KV caches on huge pages (default) or in torch's own allocations, for
    comparing the two on one machine. Applies to tensors made afterwards."""
    global _huge_pages_on
    _huge_pages_on = on


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for data a step streams through (weights, KV caches): from
    the huge-page arena, or torch's allocator when that is switched off."""
    if not _huge_pages_on:
        return torch.empty(shape, dtype=dtype)
    return _arena.empty(tuple(shape), dtype)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in `host_empty` memory."""
    out = host_empty(tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out
