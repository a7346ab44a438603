"""Timing and memory on the device, random inputs drawn there, and the guard that turns one
check's error into a FAILED row (the rest of its section still runs)."""
import gc
import statistics
import time

from .report import Row, Run, log


def synchronize(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, iters: int, warmup: int) -> float:
    """Median time of one call of fn. On CUDA from events around each call, queued behind a
    short device-side sleep so that the host's launch cost does not show in the kernel's time
    (the calls then run back to back); on the CPU from the wall clock."""
    import torch
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(2e6 * min(50.0, 0.3 * iters)))  # ~cycles at ~2 GHz: ms
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def free_device_memory(device) -> None:
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def guarded_row(run: Run, section: str, check: str, fn) -> Row:
    """fn() -> Row, or a FAILED row: one check's error does not end its section."""
    try:
        return fn()
    except Exception as e:  # reported in the table, the rest of the section goes on
        log(run, f"{section}: {check} FAILED: {type(e).__name__}: {e}")
        return Row(section, check, f"FAILED: {type(e).__name__}: {e}", verdict="FAILED")
    finally:
        free_device_memory(device_of(run))


def guarded_rows(run: Run, section: str, check: str, fn) -> list:
    try:
        return fn()
    except Exception as e:
        log(run, f"{section}: {check} FAILED: {type(e).__name__}: {e}")
        return [Row(section, check, f"FAILED: {type(e).__name__}: {e}", verdict="FAILED")]
    finally:
        free_device_memory(device_of(run))


def device_of(run: Run):
    import torch
    return torch.device(run.plan.device)


def device_generator(device, seed: int):
    """Random inputs drawn on the device itself: drawing gigabytes on the host takes long."""
    import torch
    return torch.Generator(device=device).manual_seed(seed)
