"""The machine's practical matmul rate: the yardstick for the fraction of peak a model reaches.

One measurement can be far off on a shared machine (seen here: 326 GFLOP/s in bf16 at the start
of a run, 733 minutes later), so the benchmark measures it several times, each time while its
own systems are idle, keeps every rate and holds the model to the best one.
"""
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


def _rate(run: Callable[[], object], flops: float, seconds: float, device: torch.device) -> float:
    run()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        iters += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return flops * iters / (time.perf_counter() - start) / 1e9


def matmul_gflops(dtype: torch.dtype, device: torch.device, n: int = 2048,
                  seconds: float = 2.0) -> float:
    """The rate of a large square matmul in this dtype: torch's, or on the CPU the panel
    matmul's (pagoda_kernels/cpu/panels.py) where it runs and is faster (torch's fp32 matmul, MKL,
    ran at ~160 GFLOP/s on a Zen 4 where the panels reach ~200), each for half the time."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    runs = [lambda: torch.matmul(a, b)]
    if device.type == "cpu":
        from pagoda_kernels import cpu as cpu_kernels
        pack, run = {torch.bfloat16: (cpu_kernels.pack_bf16_weight, cpu_kernels.bf16_linear),
                     torch.float32: (cpu_kernels.pack_f32_weight, cpu_kernels.f32_linear)
                     }.get(dtype, (None, None))
        packed = pack(b.t()) if pack is not None else None  # the weight [out, in] of a @ b
        if packed is not None:
            runs.append(lambda: run(a, packed, None, n))
    return max(_rate(r, 2 * n ** 3, seconds / len(runs), device) for r in runs)


@dataclass
class Yardstick:
    """Every matmul rate measured in a run, labelled with when; the best is the peak."""

    dtype: torch.dtype
    device: torch.device
    measure_gflops: Callable[[torch.dtype, torch.device], float] = matmul_gflops
    rates: list[tuple[str, float]] = field(default_factory=list)

    def measure(self, when: str) -> float:
        gflops = self.measure_gflops(self.dtype, self.device)
        self.rates.append((when, gflops))
        return gflops

    @property
    def best(self) -> float:
        return max(gflops for _, gflops in self.rates)

    def fraction(self, flops_per_s: float) -> float:
        """A FLOP rate as a fraction of the best matmul rate."""
        return flops_per_s / (self.best * 1e9)

    def summary(self) -> dict:
        return {"matmul_gflops": self.best,
                "matmul_gflops_all": [{"when": when, "gflops": g} for when, g in self.rates]}

    def describe(self) -> str:
        rates = ", ".join(f"{g:.0f} ({when})" for when, g in self.rates)
        return f"matmul {self.best:.0f} GFLOP/s, the best of: {rates}"
