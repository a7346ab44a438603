"""Process placement through the compose file's variables, as `pagoda serve --worker-cpus
--service-nice` sets them: each process applied its own at start (shared/placement.py)."""
import os

from shared.placement import parse_cpu_list
from tests.api.conftest import PLACEMENT_VARS


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def _thread_cpus(pid: int) -> list[str]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    out.append(line.split(":", 1)[1].strip())
    return out


def test_the_light_services_run_one_nice_step_down_and_the_worker_does_not(api_stack):
    # Relative to this process's own nice: the stack inherits it, and each service adds its
    # step (os.nice), capped at 19.
    base = os.nice(0)
    step = int(PLACEMENT_VARS["PAGODA_SERVICE_NICE"])
    for service, popens in api_stack.processes.items():
        for popen in popens:
            expected = base if service == "worker" else min(19, base + step)
            assert _nice(popen.pid) == expected, service


def test_the_workers_openmp_threads_are_bound_one_to_each_of_its_cpus(api_stack):
    cpus = set(parse_cpu_list(PLACEMENT_VARS["PAGODA_WORKER_CPUS"]))
    masks = [set(parse_cpu_list(text))
             for text in _thread_cpus(api_stack.processes["worker"][0].pid)]
    # The model ran at start (the profile run), so every OpenMP thread exists: each is bound
    # to a single CPU of the list, and together they cover it.
    assert set().union(*(m for m in masks if len(m) == 1)) == cpus
    if len(cpus) > 1:
        # The other threads (heartbeat, control, ZeroMQ's I/O) may run on any of them, not
        # only on the first CPU, where the main OpenMP thread is bound.
        others = [m for m in masks if len(m) > 1]
        assert others and all(m == cpus for m in others)
