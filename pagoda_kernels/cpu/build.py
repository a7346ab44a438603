"""Compiles the CPU kernels' C source with the system C compiler on first use and loads them.

The library is built for this machine's instruction set (-march=native), so it is cached per
source, compiler flags and CPU: `$PAGODA_CACHE_DIR/kernels` (default ~/.cache/pagoda/kernels).
A build takes a few seconds. Without a C compiler, or with PAGODA_CPU_KERNELS=0, `load()` returns
None and callers keep the torch ops; the reason is logged once.
"""
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading

from shared.cache import cache_root
from shared.logging import get_logger

log = get_logger("kernels")

SOURCES = ("paged_attention.c", "paged_attention_avx512.c", "paged_attention_avx2.c",
           "layer_ops.c", "sampling.c", "matmul_bf16.c", "matmul_bf16_avx2.c", "matmul_f32.c",
           "matmul_f32_avx2.c", "blocks.c", "kv_cache.c", "prefill_attention.c",
           "prefill_attention_avx2.c", "matmul_gguf.c", "matmul_int8.c", "race_sample.c")
HEADERS = ("amx.h", "avx2.h", "avx2_rows.h", "common.h", "paged_attention.h", "avx512.h",
           "layer_kernels.h", "kv_quant.h", "sampling_row.h", "prefill_attention.h")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


def cache_dir() -> str:
    return os.path.join(cache_root(), "kernels")


def _cpu_signature() -> str:
    """What -march=native depends on: the architecture and the first processor's whole
    /proc/cpuinfo entry (model and feature flags, whatever the architecture names them)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        first = ""
    lines = (line for line in first.splitlines()
             if not line.startswith(("cpu MHz", "bogomips", "BogoMIPS")))  # vary between reads
    return platform.machine() + "\n" + "\n".join(lines)


def _library_path(compiler: list[str], flags: list[str]) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    digest.update(" ".join([*compiler, *flags]).encode())
    digest.update(_cpu_signature().encode())
    return os.path.join(cache_dir(), f"pagoda_cpu_kernels_{digest.hexdigest()[:16]}.so")


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")


def _compile(compiler: list[str], flags: list[str], path: str) -> None:
    """Each source to an object file, as many at once as this process has cores (one compiler
    call for all of them took over a minute on 2 cores), then one link."""
    from concurrent.futures import ThreadPoolExecutor
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Build beside the target and rename: processes starting together never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as objects_dir:
            objects = [os.path.join(objects_dir, s.removesuffix(".c") + ".o") for s in SOURCES]
            with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
                list(pool.map(_run, ([*compiler, *flags, "-c", os.path.join(here, s), "-o", o]
                                     for s, o in zip(SOURCES, objects))))
            _run([*compiler, *flags, *objects, "-o", tmp, "-lm"])
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # mkstemp's 0600 would keep other users of a cache out
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compiler() -> list[str]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    return shlex.split(compiler)  # CC may be "ccache gcc"


def load() -> ctypes.CDLL | None:
    """The compiled kernels, building them if needed; None when they cannot be built here."""
    global _lib, _failed
    if _lib is not None or _failed is not None:  # decided: no lock on the per-op path
        return _lib
    with _lock:
        if _lib is not None or _failed is not None:
            return _lib
        try:
            if os.environ.get("PAGODA_CPU_KERNELS", "1") == "0":
                raise RuntimeError("turned off by PAGODA_CPU_KERNELS=0")
            compiler = _compiler()
            path = _library_path(compiler, FLAGS)
            # torch is imported first, so its OpenMP runtime (libgomp.so.1) is already loaded
            # and the library binds to it rather than to a second copy.
            import torch  # noqa: F401
            try:
                _lib = ctypes.CDLL(path)
            except OSError:  # not built yet, or a cached build that does not load here
                log.info("building cpu kernels", compiler=" ".join(compiler), path=path)
                _compile(compiler, FLAGS, path)
                _lib = ctypes.CDLL(path)
        except Exception as e:  # any failure leaves the torch reference ops in charge
            _failed = str(e)
            log.warning("cpu kernels unavailable, using the torch reference ops", error=_failed)
        return _lib


def unavailable_reason() -> str | None:
    load()
    return _failed


def load_variant(extra_flags: list[str]) -> ctypes.CDLL:
    """The kernels built again with `extra_flags` after the usual ones, as a library of their
    own (cached the same way), for checking another instruction set's loops on this CPU:
    `-mno-avx512f` builds the AVX2 loops on a CPU with AVX-512. Raises where that cannot be
    built; nothing else calls it, and `load()` is unaffected."""
    if load() is None:
        raise RuntimeError(f"cpu kernels unavailable: {_failed}")
    compiler = _compiler()
    flags = [*FLAGS, *extra_flags]
    path = _library_path(compiler, flags)
    try:
        return ctypes.CDLL(path)
    except OSError:  # not built yet, or a cached build that does not load here
        _compile(compiler, flags, path)
        return ctypes.CDLL(path)
