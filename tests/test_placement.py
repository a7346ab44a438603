"""shared/placement.py: CPU lists, and a process placing itself from its environment."""
import json
import os
import subprocess
import sys

import pytest

from shared.placement import Placement, PlacementError, parse_cpu_list

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_lists_read_as_taskset_and_cpuset_write_them():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("2, 0,2") == [0, 2]


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0-", ","])
def test_a_bad_cpu_list_is_refused_with_its_text(text):
    with pytest.raises(PlacementError, match="CPU list"):
        parse_cpu_list(text)


def test_an_empty_environment_places_nothing_and_a_bad_nice_is_refused():
    assert Placement.from_env({}) == Placement(None, 0)
    assert Placement.from_env({"PAGODA_CPUS": "", "PAGODA_NICE": ""}) == Placement(None, 0)
    with pytest.raises(PlacementError, match="PAGODA_NICE"):
        Placement.from_env({"PAGODA_NICE": "low"})


PROBE = """
import json, os
from shared.placement import apply_placement
placement = apply_placement("worker")
import torch
torch.ones(256, 256) @ torch.ones(256, 256)  # starts the OpenMP threads
print(json.dumps({"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                  "nice": os.nice(0)}))
"""


def test_a_worker_pins_itself_and_runs_one_openmp_thread_per_cpu():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**env, "PYTHONPATH": ROOT, "PAGODA_CPUS": str(cpu),
                                           "PAGODA_NICE": "2"})
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe == {"affinity": [cpu], "threads": 1, "nice": os.nice(0) + 2}


def test_a_service_given_cpus_it_may_not_use_exits_naming_them():
    missing = max(os.sched_getaffinity(0)) + 1
    out = subprocess.run([sys.executable, "-m", "pagoda", "detokenizer", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PAGODA_CPUS": str(missing)})
    assert out.returncode != 0
    assert f"CPUs [{missing}] are not available" in out.stderr


def test_pagoda_serve_refuses_a_bad_cpu_list_before_starting_anything(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pagoda", "serve", "--worker-cpus", "3-1",
                          "--run-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "bad CPU list '3-1'" in out.stdout
    assert not (tmp_path / "logs").exists()


def test_pagoda_serve_refuses_cpus_this_machine_does_not_give_it(tmp_path):
    missing = max(os.sched_getaffinity(0)) + 1
    out = subprocess.run([sys.executable, "-m", "pagoda", "serve", "--worker-cpus", str(missing),
                          "--run-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert f"CPUs [{missing}] are not available" in out.stdout


SPREAD = """
import json, os, threading
from shared.placement import apply_placement, spread_this_thread
apply_placement("worker")
import torch
torch.ones(256, 256) @ torch.ones(256, 256)
seen = {}
def helper(name, spread):
    if spread:
        spread_this_thread()
    seen[name] = sorted(os.sched_getaffinity(0))
for name, spread in (("inherited", False), ("spread", True)):
    t = threading.Thread(target=helper, args=(name, spread))
    t.start()
    t.join()
print(json.dumps(seen))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell them apart")
def test_a_helper_thread_of_a_bound_worker_runs_on_all_its_cpus_not_the_first():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", SPREAD], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={**env, "PYTHONPATH": ROOT, "PAGODA_CPUS": ",".join(map(str, cpus))})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # The bound OpenMP runtime pinned the main thread to the first CPU: a new thread inherits
    # that, and spread_this_thread gives it the whole list back.
    assert seen == {"inherited": cpus[:1], "spread": cpus}
