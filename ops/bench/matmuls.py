"""fp32 matmul rates: the panel matmul (pagoda_kernels/cpu, each block height) against oneDNN's
packed matmul and MKL's sgemm on [in, out], the three layouts `fp32_layout` chooses between.

Each `--shape ROWSxNxK` (x [ROWS, K] times W [N, K]^T) is timed on every side in turn, call
after call, `--repeats` rounds, so that drift in the machine's speed reaches them alike; the
figure is each side's fastest call, in GFLOP/s. The weights are cache-warm after the first
call wherever they fit the caches: the decode step's streamed weights are `bench kernels`'.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

# The default model's layer shapes at a decode batch of 64 and a 2,048-token prompt step.
DEFAULT_SHAPES = ["64x960x576", "64x3072x576", "64x576x1536", "64x576x576", "64x49152x576",
                  "2048x3072x576", "2048x576x1536", "1x3072x576", "8x3072x576"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", nargs="+", default=DEFAULT_SHAPES, metavar="ROWSxNxK")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output-json", default=None)


def _parse(shape: str) -> tuple[int, int, int]:
    try:
        rows, n, k = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shape {shape!r}: expected ROWSxNxK, for example 64x960x576")
    if min(rows, n, k) < 1:
        raise SystemExit(f"--shape {shape!r}: every size must be positive")
    return rows, n, k


def _sides(rows: int, n: int, k: int) -> tuple[dict, dict]:
    """name -> a call computing x W^T on that side, checked against F.linear first; and for
    the panel sides, name -> the block height to set before calling it. oneDNN's weight is
    packed for 64 rows, as the engine packs it."""
    from pagoda_kernels import cpu
    from services.worker.models.linear import _onednn

    g = torch.Generator().manual_seed(rows + n + k)
    x, weight = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    transposed = weight.t().contiguous().t()
    sides = {"mkl [in, out]": lambda: F.linear(x, transposed)}
    if _onednn(torch.float32):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        sides["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none",
                                                                    [], "")
    panels = cpu.pack_f32_weight(weight)
    heights = {}
    for height in (cpu.f32_block_rows() if panels is not None else ()):
        heights[f"panels {height} rows"] = height
        sides[f"panels {height} rows"] = lambda: cpu.f32_linear(x, panels, None, n)
    expected = F.linear(x, weight)
    for name, side in sides.items():
        if name in heights:
            cpu.set_f32_block_rows(heights[name])
        if not torch.allclose(side(), expected, rtol=1e-4, atol=1e-3 * k ** 0.5):
            raise SystemExit(f"{name} gives another product than F.linear at {rows}x{n}x{k}")
    return sides, heights


def run(args: argparse.Namespace) -> int:
    from pagoda_kernels import cpu

    shapes = [_parse(s) for s in args.shape]
    before = cpu.f32_block_rows_now()
    print(f"fp32 matmuls, {torch.get_num_threads()} threads; GFLOP/s of the fastest of "
          f"{args.repeats} calls each, sides alternating")
    results = []
    try:
        with torch.inference_mode():
            for rows, n, k in shapes:
                sides, heights = _sides(rows, n, k)
                best = dict.fromkeys(sides, float("inf"))
                for _ in range(args.repeats):
                    for name, side in sides.items():
                        if name in heights:
                            cpu.set_f32_block_rows(heights[name])
                        start = time.perf_counter()
                        side()
                        best[name] = min(best[name], time.perf_counter() - start)
                rates = {name: 2 * rows * n * k / s / 1e9 for name, s in best.items()}
                print(f"{rows}x{n}x{k}: "
                      + "  ".join(f"{name} {r:.1f}" for name, r in rates.items()))
                results.append({"rows": rows, "n": n, "k": k, "gflops": rates})
    finally:
        if before is not None:
            cpu.set_f32_block_rows(before)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)
        print(f"saved {args.output_json}")
    return 0
