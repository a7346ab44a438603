"""Process trees of the benchmarks' peers (Linux /proc): their members, CPU time, signals,
quiet, and each member's role by its command line."""
import glob
import os
import time


def process_tree(pid: int) -> list[int]:
    """A process and its descendants (Linux /proc; just the process elsewhere)."""
    tree, pending = [], [pid]
    while pending:
        p = pending.pop()
        tree.append(p)
        for children in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(children) as f:
                    pending += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue  # gone meanwhile
    return tree


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds used so far by one process and its threads; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a process, its threads and its descendants (Linux /proc)."""
    return sum(s for s in map(process_cpu_s, process_tree(pid)) if s is not None)


def signal_tree(pid: int, sig: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def wait_until_idle(pid: int, below_cores: float = 0.1, window_s: float = 0.25,
                    timeout_s: float = 30.0) -> float:
    """Waits until the process tree uses under `below_cores` over a window -> seconds waited."""
    if not os.path.exists(f"/proc/{pid}/stat"):
        return 0.0
    start = time.perf_counter()
    last = process_tree_cpu_s(pid)
    while time.perf_counter() - start < timeout_s:
        time.sleep(window_s)
        now = process_tree_cpu_s(pid)
        if now - last < below_cores * window_s:
            break
        last = now
    return time.perf_counter() - start


def die_with_parent() -> None:
    """A pre-exec for Popen: SIGKILL when the process that started this one dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def pagoda_role(argv: list[str], is_root: bool = False) -> str:
    """The service of a `python -m pagoda <service> ...` process (serve for the launcher)."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "pagoda" and i > 0 and argv[i - 1] == "-m":
            return argv[i + 1]
    return "other"


def vllm_role(argv: list[str], is_root: bool) -> str:
    """vLLM's processes: the one started is the API server; the engine core names itself
    (setproctitle: VLLM::EngineCore), and so do its workers where it has some."""
    title = " ".join(argv)
    if "EngineCore" in title:
        return "engine core"
    if "APIServer" in title or is_root:
        return "api server"
    if "::Worker" in title:
        return "worker"
    return "other"


def cpu_by_pid(root: int, role_of) -> dict[int, tuple[str, float]]:
    """Each live process of the tree -> (its role, CPU seconds so far); `role_of(argv,
    is_root)` names the role."""
    out = {}
    for pid in process_tree(root):
        seconds = process_cpu_s(pid)
        if seconds is not None:
            out[pid] = (role_of(cmdline(pid), pid == root), seconds)
    return out


def cpu_delta_by_role(before: dict[int, tuple[str, float]],
                      after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds used between two `cpu_by_pid` snapshots, summed by role. A process born
    between them counts whole; one that died between them is lost (its last share unknown)."""
    totals: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        start = before.get(pid, (role, 0.0))[1]
        totals[role] = totals.get(role, 0.0) + max(0.0, seconds - start)
    return dict(sorted(totals.items()))
