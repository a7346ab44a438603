"""Worker on the CPU with a tiny random model: the KV cache it sizes and allocates for an engine,
and what happens to an old engine's cache when a new engine sets the worker up again."""
import weakref

import pytest

from services.worker.worker import Worker
from shared.engine_args import EngineArgs
from tests.helpers import save_random_model, tiny_llama_config
from tests.test_host_memory import run_fresh

# 3 layers, 2 KV heads of 16, float32: 12 KiB a block of 16 tokens.
BLOCK_BYTES = 2 * 3 * 16 * 2 * 16 * 4


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-worker")
    save_random_model(tiny_llama_config(), folder)
    return str(folder)


def new_worker(model_folder: str, **engine_args) -> Worker:
    """A loaded worker; init_device is left out (it sets process-wide malloc options)."""
    args = dict(model=model_folder, device="cpu", max_model_len=64, kv_cache_space_gib=0.01)
    config = EngineArgs(**{**args, **engine_args}).create_engine_config()
    worker = Worker(config)
    worker.load_model()
    return worker


def test_swap_blocks_only_in_swap_mode(model_folder):
    # swap_space is given in both cases; only preemption by swap ever uses it.
    for mode, num_cpu in (("recompute", 0), ("swap", (1 << 30) // 64 // BLOCK_BYTES)):
        worker = new_worker(model_folder, preemption_mode=mode, swap_space=1 / 64)
        num_device, num_cpu_blocks = worker.determine_num_available_blocks()
        assert (num_device, num_cpu_blocks) == (int(0.01 * (1 << 30)) // BLOCK_BYTES, num_cpu)
        worker.initialize_cache(num_device, num_cpu_blocks)
        for k, v in worker.cache_engine.cpu_cache:
            assert k.shape[0] == v.shape[0] == num_cpu
            assert (k.numel() == 0) == (mode == "recompute")


def test_a_new_engines_setup_frees_the_old_cache_and_sizes_the_same_one(model_folder):
    worker = new_worker(model_folder, preemption_mode="swap", swap_space=0.005)
    runner = worker.model_runner
    sizes = []
    for _ in range(3):  # three engines, one after the other, on the same worker
        sizes.append(worker.determine_num_available_blocks())
        worker.initialize_cache(*sizes[-1])
        cache = worker.cache_engine
        old = [weakref.ref(cache)] + [weakref.ref(t) for t in cache._device_kv + cache._cpu_kv]
        runner.seqs[7] = runner.requests["r"] = runner.fan_out[7] = object()  # the old engine's
        del cache
        sizes.append(worker.determine_num_available_blocks())
        assert all(ref() is None for ref in old)  # freed before the new engine's sizing
        assert worker.cache_engine is None and runner.kv_caches is None
        assert not runner.seqs and not runner.requests and not runner.fan_out
    assert len(set(sizes)) == 1 and sizes[0][0] > 0 and sizes[0][1] > 0


def test_initialize_cache_frees_the_old_cache_before_allocating(model_folder, monkeypatch):
    from services.worker import cache_engine
    worker = new_worker(model_folder)
    worker.initialize_cache(8, 0)
    old = weakref.ref(worker.cache_engine._device_kv[0])
    old_alive_at_allocation = []

    def host_empty(*args, _host_empty=cache_engine.host_empty):
        old_alive_at_allocation.append(old() is not None)
        return _host_empty(*args)

    monkeypatch.setattr(cache_engine, "host_empty", host_empty)
    worker.initialize_cache(8, 0)  # no determine_num_available_blocks in between
    assert old_alive_at_allocation == [False] * 3  # one per layer
    assert worker.cache_engine.num_device_blocks == 8


# The peak over three engine set-ups, in a fresh interpreter (the high-water mark of resident
# memory is per process). Each layer's cache is 64 MiB, over half a huge-page arena chunk, so it
# has a mapping of its own that goes back to the OS with it; the device cache is zero-filled,
# so all of it is resident.
PEAK = """
    import json
    from services.worker.worker import Worker
    from shared.engine_args import EngineArgs

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    config = EngineArgs(model={folder!r}, device="cpu", max_model_len=64,
                        kv_cache_space_gib=0.1875).create_engine_config()
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    peaks, resident_freed = [], []
    for _ in range(3):
        worker.initialize_cache(*worker.determine_num_available_blocks())
        peaks.append(status_kib("VmHWM"))
        resident = status_kib("VmRSS")
        worker.determine_num_available_blocks()  # the next engine's first call
        resident_freed.append(resident - status_kib("VmRSS"))
    print(json.dumps({{"peaks": peaks, "freed": resident_freed}}))
"""


def test_the_peak_does_not_grow_when_engines_come_and_go(model_folder):
    cache_kib = int(0.1875 * (1 << 30)) // 1024
    result = run_fresh(PEAK.format(folder=model_folder))
    peaks, freed = result["peaks"], result["freed"]
    # Holding the old cache while the new one is allocated would add a whole cache each time.
    assert peaks[-1] - peaks[0] < cache_kib // 4, result
    assert all(kib > cache_kib * 3 // 4 for kib in freed), result
