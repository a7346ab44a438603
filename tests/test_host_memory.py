"""The CPU worker's malloc settings (services/worker/host_memory.py), seen in what they are for:
a freed activation's pages are reused by the next allocation instead of being faulted in again.
Each case runs in a fresh interpreter, since the settings are process-wide."""
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALLOCATE = """
    import json, resource, torch
    from services.worker.host_memory import keep_freed_memory
    taken = keep_freed_memory(*{settings})

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    sizes = (1 << 20, 3 << 20)  # float32 tensors of 4 and 12 MiB, a step's logits' sizes
    for _ in range(5):  # whatever the first allocations of each size cost
        for numel in sizes:
            torch.empty(numel).fill_(1.0)
    before = faults()
    for _ in range(50):
        for numel in sizes:
            torch.empty(numel).fill_(1.0)
    print(json.dumps({{"taken": taken, "faults": (faults() - before) / 50}}))
"""


def allocate(settings: tuple) -> dict:
    code = textwrap.dedent(ALLOCATE.format(settings=settings))
    result = subprocess.run([sys.executable, "-c", code],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_freed_activation_memory_is_reused_rather_than_faulted_in_again():
    # glibc's starting values, held fixed (glibc moves them with what a process frees, so its
    # own defaults behave one way or the other depending on the process's history).
    glibc_start = allocate((128 << 10, 128 << 10, 0))
    tuned = allocate(())  # the worker's settings
    assert glibc_start["taken"] is True and tuned["taken"] is True  # glibc here
    # Fresh mmaps each time: their pages fault in again, every round (8 where transparent huge
    # pages serve all of it, dozens where they serve some, thousands without).
    assert glibc_start["faults"] >= 4
    assert tuned["faults"] <= 1


def test_the_cpu_worker_applies_them_when_it_starts(monkeypatch):
    from services.worker import worker as worker_module
    from shared.config import EngineArgs
    calls = []
    monkeypatch.setattr(worker_module, "keep_freed_memory", lambda: calls.append(True))
    config = EngineArgs(max_model_len=64).create_engine_config()
    assert config.device_config.device.type == "cpu"
    worker_module.Worker(config).init_device()
    assert calls == [True]
