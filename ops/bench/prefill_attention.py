"""Prefill attention of whole prompts on the CPU: the C kernel (kernels/cpu/prefill_attention.c)
against torch SDPA (kernels.reference.causal_prefill_attention), alternately in one process.

    .venv/bin/python -m ops.bench.prefill_attention [--threads 2] [--dtype bfloat16]

Shapes default to SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64); each
workload is `batch x length` prompts of one length in one call, as one layer of a prefill step
sees them, and the times are best of `--repeats`, scaled to `--layers` layers.
"""
import argparse
import itertools
import time

import torch


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["64x128", "8x1024"],
                        help="BATCHxLENGTH prompts per call")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from kernels import cpu
    from kernels.reference import causal_prefill_attention

    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, heads {args.heads}/{args.kv_heads}, head_dim "
          f"{args.head_dim}, paths {cpu.prefill_paths()}; ms per layer (x{args.layers} layers)")
    g = torch.Generator().manual_seed(0)
    for dtype_name, workload in itertools.product(args.dtype, args.workloads):
        dtype = getattr(torch, dtype_name)
        batch, length = (int(x) for x in workload.split("x"))
        tokens = batch * length
        q = torch.randn(tokens, args.heads, args.head_dim, generator=g).to(dtype)
        k = torch.randn(tokens, args.kv_heads, args.head_dim, generator=g).to(dtype)
        v = torch.randn(tokens, args.kv_heads, args.head_dim, generator=g).to(dtype)
        starts = torch.arange(0, tokens + 1, length, dtype=torch.int64)
        scale = args.head_dim ** -0.5
        ops = {"kernel": cpu.causal_prefill_attention, "torch": causal_prefill_attention}
        times = {name: float("inf") for name in ops}
        for _ in range(2):  # alternate, so that a busy moment does not favour one side
            for name, op in ops.items():
                times[name] = min(times[name], _best_ms(
                    lambda op=op: op(q, k, v, starts, length, scale), args.repeats))
        kernel, torch_ms = times["kernel"], times["torch"]
        print(f"{dtype_name:9s} {workload:>8s}: kernel {kernel:7.1f} ms "
              f"({kernel * args.layers / 1e3:5.2f} s), torch {torch_ms:7.1f} ms "
              f"({torch_ms * args.layers / 1e3:5.2f} s), torch / kernel "
              f"{torch_ms / kernel:4.2f}")


if __name__ == "__main__":
    main()
