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
    return run_fresh(ALLOCATE.format(settings=settings))


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
    from shared.engine_args import EngineArgs
    calls = []
    monkeypatch.setattr(worker_module, "keep_freed_memory", lambda: calls.append(True))
    config = EngineArgs(max_model_len=64).create_engine_config()
    assert config.device_config.device.type == "cpu"
    worker_module.Worker(config).init_device()
    assert calls == [True]


# -- huge pages ----------------------------------------------------------------------------------
def _thp_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _mapping_of(address: int) -> dict | None:
    """The /proc/self/smaps entry of the mapping holding `address`: its range and kB fields."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                if entry is not None:
                    return entry
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                entry = {"range": (lo, hi)} if lo <= address < hi else None
            elif entry is not None and head[0].endswith(":") and len(head) >= 2:
                entry[head[0][:-1]] = int(head[1]) if head[1].isdigit() else head[1]
    return entry


def test_arena_tensors_are_page_aligned_and_do_not_overlap():
    import torch
    from services.worker.host_memory import HugePageArena
    arena = HugePageArena(chunk_bytes=8 << 20)
    shapes = [((3, 100), torch.bfloat16), ((1000,), torch.float32), ((5 << 20,), torch.uint8),
              ((2, 7, 16, 3, 64), torch.bfloat16), ((9 << 20,), torch.uint8)]  # the last > chunk
    tensors = [arena.empty(shape, dtype) for shape, dtype in shapes]
    for i, (t, (shape, dtype)) in enumerate(zip(tensors, shapes)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 4096 == 0
        t.fill_(i + 1)
    for i, t in enumerate(tensors):  # nothing written later landed in an earlier tensor
        assert torch.all(t == i + 1), i
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def run_fresh(code: str) -> dict:
    """Runs `code` in a fresh interpreter and returns the JSON its last line prints: malloc
    settings are process-wide, and page backing depends on a process's history (which
    libraries advised which ranges), so these checks start from none."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def _thp_mode() -> str:
    import pytest
    if not _thp_offered():
        pytest.skip("this kernel offers no transparent huge pages")
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f.read().split("[")[1].split("]")[0]


def test_arena_memory_is_backed_by_huge_pages_where_the_kernel_offers_them():
    mode = _thp_mode()
    kb = run_fresh("""
        import json, torch
        from services.worker.host_memory import HugePageArena
        from tests.test_host_memory import _mapping_of
        t = HugePageArena().empty((16 << 20,), torch.uint8).fill_(1)  # faulted in here
        plain = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # torch's own, for contrast
        print(json.dumps({name: _mapping_of(x.data_ptr()).get("AnonHugePages", 0)
                          for name, x in (("arena", t), ("plain", plain))}))
    """)
    assert kb["arena"] * 1024 >= (16 << 20) - (2 << 20), kb
    if mode == "madvise":  # torch does not advise huge pages (under `always` both get them)
        assert kb["plain"] < 16 << 10, kb


def test_a_mapping_is_released_with_its_last_tensor():
    import gc
    import torch
    from services.worker.host_memory import HugePageArena
    arena = HugePageArena(chunk_bytes=4 << 20)
    big = arena.empty((12 << 20,), torch.uint8)  # a mapping of its own
    start = big.data_ptr()
    end = start + (12 << 20)

    def mapped_whole() -> bool:
        # The kernel may merge the mapping with a neighbour of the same flags, or split such a
        # merge again when the neighbour goes: what counts is that the whole range is mapped.
        entry = _mapping_of(start)
        return entry is not None and entry["range"][0] <= start and end <= entry["range"][1]
    assert mapped_whole()
    view = big[100:200]
    del big
    gc.collect()
    assert mapped_whole()  # a view still holds it
    del view
    gc.collect()
    assert not mapped_whole()


def test_weights_and_kv_cache_are_on_huge_pages_unless_switched_off():
    mode = _thp_mode()
    kb = run_fresh("""
        import json, torch
        from services.worker import host_memory
        from services.worker import cache_engine
        from services.worker.cache_engine import CacheEngine
        from services.worker.models.linear import Linear, set_fp32_layout
        set_fp32_layout("transposed")  # the layout that keeps fp32 weights on huge pages
        from tests.test_cache_engine import cache_config, model_config
        from tests.test_host_memory import _mapping_of

        def huge_kb(t):
            return _mapping_of(t.data_ptr()).get("AnonHugePages", 0)

        # Whatever memory the cache gets, it must come out zero-filled: hand it NaN-filled
        # memory (a fresh mapping would be zero by itself).
        def nan_filled(shape, dtype, _empty=cache_engine.host_empty):
            return _empty(shape, dtype).fill_(float("nan"))
        cache_engine.host_empty = nan_filled

        def build():
            kv = CacheEngine(cache_config(), model_config(torch.bfloat16), torch.device("cpu"))
            k, v = kv.device_cache[0]
            found = {"kv_zero": int(torch.count_nonzero(k) + torch.count_nonzero(v)) == 0,
                     "kv": huge_kb(k)}
            for dtype in (torch.bfloat16, torch.float32):
                layer = Linear(512, 1024, bias=False, dtype=dtype)
                layer.weight.data.normal_()
                layer.pack()  # bf16: panel or oneDNN packing; fp32: a transposed copy
                # Streamed weights only: panel-packed bf16 and fp32 ([in, out] copies). oneDNN's
                # packing is opaque, and an unpacked bf16 weight stays as loaded.
                if dtype == torch.float32:
                    found[str(dtype)] = huge_kb(layer.weight)
                elif layer.packed is not None and layer.packed.kind == "bf16":
                    found[str(dtype)] = huge_kb(layer.packed.data)
                else:
                    found[str(dtype)] = None
            return found

        on = build()
        host_memory.use_huge_pages(False)
        print(json.dumps({"on": on, "off": build()}))
    """)
    on, off = kb["on"], kb["off"]
    assert on["kv_zero"] and off["kv_zero"]  # masked slots must hold finite numbers
    assert on["kv"] >= 2048 and on["torch.float32"] >= 2048, on
    assert on["torch.bfloat16"] is None or on["torch.bfloat16"] >= 2048, on
    if mode == "madvise":  # torch's allocator never advises huge pages
        assert off["kv"] == 0 and off["torch.float32"] == 0, off
