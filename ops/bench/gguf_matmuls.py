"""Kernel-level timing of one GGUF matmul (pagoda_kernels/cpu/matmul_gguf.c) against what
services/worker/models/gguf_weights.py does above KERNEL_MAX_ROWS (the weight dequantized into
a temporary of x's dtype, then F.linear), and F.linear alone on the weight dequantized once
(the temporary's cost left out; a dense model's own packed layouts are not this), for the
default model's MLP shapes, random weights quantized by gguf (Q4_1 unless `--type`), at the
given rows. Prints a table row per row count; best of `--repeats` runs, microseconds:

    .venv/bin/python -m ops.bench.gguf_matmuls --rows 1 8 16 32 64 128 --repeats 15
"""
import argparse

import numpy as np
import torch
import torch.nn.functional as F

from pagoda_kernels import cpu as cpu_kernels
from ops.bench.timing import best_seconds

SHAPES = [(576, 3072), (1536, 576)]  # (K, N): gate/up and down of SmolLM2-135M


def _weight(qtype_name: str, k: int, n: int):
    import gguf

    from services.worker.models.gguf_weights import GGUFWeight, allocate_part, fill_from_blocks
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = (np.random.default_rng(0).standard_normal((n, k)) * 0.02).astype(np.float32)
    part = allocate_part(int(qtype), 0, n, k)
    fill_from_blocks(part, 0, gguf.quants.quantize(w, qtype))
    return GGUFWeight(k, [part])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--type", default="Q4_1", choices=["Q8_0", "Q4_0", "Q4_1"])
    args = parser.parse_args(argv)
    if cpu_kernels.load() is None:
        raise SystemExit(f"cpu kernels unavailable: {cpu_kernels.unavailable_reason()}")
    dtypes = [torch.float32, torch.bfloat16]
    print(f"threads {torch.get_num_threads()}, {args.type}, VNNI "
          f"{cpu_kernels.gguf_simd_available()}; kernel / dequantized temporary + dense / "
          f"dense alone, best of {args.repeats}, us")
    header = " | ".join(f"{k}x{n} {str(d)[6:]}" for k, n in SHAPES for d in dtypes)
    print(f"| rows | {header} |\n|---|" + "---|" * (len(SHAPES) * len(dtypes)))
    weights = {shape: _weight(args.type, *shape) for shape in SHAPES}
    dense = {(shape, d): weights[shape].dequantize(d) for shape in SHAPES for d in dtypes}
    for rows in args.rows:
        cells = []
        for shape in SHAPES:
            weight, part = weights[shape], weights[shape].parts[0]
            for dtype in dtypes:
                x = torch.randn(rows, shape[0]).to(dtype)
                out = torch.empty(rows, shape[1], dtype=dtype)
                kernel = 1e6 * best_seconds(lambda: cpu_kernels.gguf_matmul(
                    x, part.qtype, part.qs, part.d, part.m, None, out), args.repeats)
                temporary = 1e6 * best_seconds(lambda: F.linear(x, weight.dequantize(dtype)),
                                     args.repeats)
                alone = 1e6 * best_seconds(lambda: F.linear(x, dense[(shape, dtype)]), args.repeats)
                cells.append(f"{kernel:.0f} / {temporary:.0f} / {alone:.0f}")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
