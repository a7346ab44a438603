"""The env section: the GPU, the torch / triton / transformers versions, the device-to-device
copy bandwidth (bytes read + written) and the bf16 matmul rate: the ceilings everything else is
measured against."""
import functools
import os
import sys

from .measure import free_device_memory, median_seconds
from .report import Row, Run, log, num


def section_env(run: Run, device) -> list:
    import torch
    import triton
    import transformers
    plan = run.plan
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = (f"{props.name}, {props.multi_processor_count} SMs, "
               f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    else:
        gpu = f"none (smoke mode on the CPU, {os.cpu_count()} cores)"
    versions = (f"torch {torch.__version__}, triton {triton.__version__}, transformers "
                f"{transformers.__version__}, Python {sys.version.split()[0]}")
    run.meta.update(gpu=gpu, versions=versions)
    log(run, f"env: {gpu}; {versions}")

    copy_s = copy_seconds(device, plan.copy_bytes, plan.env_iters)
    run.copy_bytes_per_s = 2 * plan.copy_bytes / copy_s  # read + written
    log(run, f"env: copy of {plan.copy_bytes / 2**30:.2f} GiB in {copy_s * 1e3:.3f} ms: "
             f"{num(run.copy_bytes_per_s / 1e9)} GB/s")
    n = plan.matmul_n
    matmul_s = matmul_seconds(device, n, plan.env_iters)
    run.matmul_flop_per_s = 2 * n ** 3 / matmul_s
    log(run, f"env: bf16 matmul {n}^3 in {matmul_s * 1e3:.3f} ms: "
             f"{num(run.matmul_flop_per_s / 1e12)} TFLOP/s")
    run.raw["env"] = dict(gpu=gpu, versions=versions, copy_bytes=plan.copy_bytes,
                          copy_s=copy_s, copy_bytes_per_s=run.copy_bytes_per_s, matmul_n=n,
                          matmul_s=matmul_s, matmul_flop_per_s=run.matmul_flop_per_s)
    return [
        Row("env", "device", gpu),
        Row("env", "software", versions),
        Row("env", "copy bandwidth (device to device)",
            f"{num(run.copy_bytes_per_s / 1e9)} GB/s read + written "
            f"({plan.copy_bytes / 2**30:.2f} GiB copy_, median of {plan.env_iters})"),
        Row("env", f"bf16 matmul {n}x{n}x{n}",
            f"{num(run.matmul_flop_per_s / 1e12)} TFLOP/s (random data, median of "
            f"{plan.env_iters})"),
    ]


def copy_seconds(device, num_bytes: int, iters: int) -> float:
    import torch
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(functools.partial(dst.copy_, src), device, iters, warmup=3)
    del src, dst
    free_device_memory(device)
    return seconds


def matmul_seconds(device, n: int, iters: int) -> float:
    import torch
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    seconds = median_seconds(functools.partial(torch.matmul, a, b, out=c), device, iters,
                             warmup=3)
    del a, b, c
    free_device_memory(device)
    return seconds
