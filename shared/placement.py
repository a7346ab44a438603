"""Where a service process runs: the CPUs it may use and its scheduling priority.

Each process reads its own placement from its environment when it starts, before torch (and
with it the OpenMP runtime) is imported, so that `pagoda serve` and compose place processes the
same way: `PAGODA_CPUS` (a CPU list such as `0-13` or `0,2,4`) and `PAGODA_NICE` (added to the
process's nice value). A worker given CPUs runs one OpenMP thread per CPU, each bound to its own
(unless OMP_NUM_THREADS / OMP_PLACES / OMP_PROC_BIND are already set), as a worker that owns its
cores should; the light services given other CPUs then never preempt its threads.
"""
import os
from dataclasses import dataclass

_placed_cpus: list[int] | None = None  # this process's CPUs, once apply_placement pinned it


class PlacementError(ValueError):
    pass


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (sorted, without repeats)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise PlacementError(f"bad CPU list {text!r}: {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise PlacementError(f"bad CPU list {text!r}: {part!r} is not an ascending range")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise PlacementError(f"bad CPU list {text!r}: no CPUs")
    return sorted(cpus)


@dataclass
class Placement:
    cpus: list[int] | None = None  # None: wherever the OS puts it
    nice: int = 0

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> "Placement":
        cpus_text = environ.get("PAGODA_CPUS", "").strip()
        nice_text = environ.get("PAGODA_NICE", "").strip()
        try:
            nice = int(nice_text) if nice_text else 0
        except ValueError:
            raise PlacementError(f"PAGODA_NICE must be an integer, got {nice_text!r}") from None
        return cls(parse_cpu_list(cpus_text) if cpus_text else None, nice)


def rank_cpus(cpus: list[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s share of `cpus` among `world_size` ranks: contiguous, as even as it goes;
    with fewer CPUs than ranks, ranks share them in turn."""
    if len(cpus) < world_size:
        return [cpus[rank % len(cpus)]]
    base, extra = divmod(len(cpus), world_size)
    start = rank * base + min(rank, extra)
    return cpus[start:start + base + (1 if rank < extra else 0)]


def placed_cpus() -> list[int] | None:
    """The CPUs apply_placement pinned this process to (None: not placed)."""
    return _placed_cpus


def spread_this_thread() -> None:
    """Lets the calling thread run on all of the process's CPUs again. A bound OpenMP runtime
    pins the main thread to the first CPU, and threads started later inherit that mask: the
    worker's heartbeat and control threads call this, so that they do not all preempt the
    OpenMP thread every barrier waits for. Nothing happens in a process that was not placed."""
    if _placed_cpus is not None:
        os.sched_setaffinity(0, _placed_cpus)  # 0: the calling thread, on Linux


def apply_placement(service: str, environ=os.environ) -> Placement:
    """Pins this process to its CPUs and lowers its priority as its environment says; for the
    worker, also sets the OpenMP environment its runtime reads when torch loads it. Raises
    PlacementError for CPUs this process may not use."""
    placement = Placement.from_env(environ)
    if placement.cpus is not None:
        allowed = os.sched_getaffinity(0)
        outside = [c for c in placement.cpus if c not in allowed]
        if outside:
            raise PlacementError(f"PAGODA_CPUS={environ['PAGODA_CPUS']}: CPUs {outside} are not "
                                 f"available here (available: {sorted(allowed)})")
        os.sched_setaffinity(0, placement.cpus)
        global _placed_cpus
        _placed_cpus = placement.cpus
        if service == "worker":
            environ.setdefault("OMP_NUM_THREADS", str(len(placement.cpus)))
            if "OMP_PLACES" not in environ and "GOMP_CPU_AFFINITY" not in environ:
                environ["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in placement.cpus)
                environ.setdefault("OMP_PROC_BIND", "close")
    if placement.nice:
        try:
            os.nice(placement.nice)
        except OSError as e:  # a negative value without the privilege to raise priority
            raise PlacementError(f"PAGODA_NICE={placement.nice}: {e.strerror}") from None
    return placement
