"""Kernel-level timing of one decode step's matmuls of the default model (SmolLM2-135M: 30
layers of qkv 576 -> 960, o 576 -> 576, gate/up 576 -> 2 x 1536 with the fused SiLU, down
1536 -> 576, then the tied head 576 -> 49152), random weights, each matmul's weight read once
per step: bf16 panels (pagoda_kernels/cpu/matmul_bf16.c) against int8 weight-only and w8a8
(pagoda_kernels/cpu/matmul_int8.c), at the given batch rows. Prints each configuration's best and
median step time and the weight bytes per second at the best.

    .venv/bin/python -m ops.bench.int8_matmuls --rows 1 64 --seconds 1.5
"""
import argparse
import time

import torch

from pagoda_kernels import cpu as cpu_kernels

LAYERS = 30
LAYER_SHAPES = [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False)]
HEAD = (49152, 576, False)


def _weights() -> list[dict]:
    torch.manual_seed(0)
    out = []
    for n, k, gate_up in LAYER_SHAPES * LAYERS + [HEAD]:
        w = torch.randn(n, k) * 0.02
        scale = w.abs().amax(dim=1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        out.append(dict(n=n, k=k, gate_up=gate_up,
                        bf16=cpu_kernels.pack_bf16_weight(w.bfloat16(), gate_up),
                        int8=cpu_kernels.pack_int8_weight(q, gate_up),
                        scale=scale.float().contiguous(),
                        sums=q.sum(dim=1, dtype=torch.int32)))
    return out


def _time_step(weights: list[dict], kind: str, rows: int, dtype: torch.dtype,
               seconds: float) -> tuple[float, float]:
    xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}

    def step():
        for w in weights:
            x = xs[w["k"]]
            if kind == "bf16":
                cpu_kernels.bf16_linear(x, w["bf16"], None, w["n"], w["gate_up"])
            else:
                cpu_kernels.int8_linear(x, w["int8"], w["scale"], w["sums"], None, w["n"],
                                        w["k"], w["gate_up"], kind == "w8a8")

    step()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[0], times[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--seconds", type=float, default=1.5, help="per configuration")
    args = parser.parse_args(argv)
    if not cpu_kernels.bf16_matmul_available():
        raise SystemExit("the bf16 panel matmul does not run here: nothing to compare against")
    weights = _weights()
    configs = [("bf16", torch.bfloat16), ("w8a8", torch.bfloat16), ("w8a8", torch.float32),
               ("int8", torch.bfloat16), ("int8", torch.float32)]
    print(f"threads {torch.get_num_threads()}, int8 paths: weight-only "
          f"{cpu_kernels.int8_paths(False)}, w8a8 {cpu_kernels.int8_paths(True)}")
    for rows in args.rows:
        for kind, dtype in configs:
            best, median = _time_step(weights, kind, rows, dtype, args.seconds)
            nbytes = sum(w["int8"].numel() * (2 if kind == "bf16" else 1) for w in weights)
            print(f"rows {rows:3d}  {kind:4s} weights, {str(dtype)[6:]:8s} activations: best "
                  f"{best * 1e3:7.2f} ms, median {median * 1e3:7.2f} ms "
                  f"({nbytes / best / 1e9:5.1f} GB/s of weights at the best)", flush=True)


if __name__ == "__main__":
    main()
