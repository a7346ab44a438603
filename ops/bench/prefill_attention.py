"""Prefill attention of whole prompts on the CPU: the cpu attention backend, which runs the C
kernel (pagoda_kernels/cpu/prefill_attention.c), against the torch backend (SDPA,
pagoda_kernels.reference.causal_prefill_attention), alternately in one process.

    .venv/bin/python -m ops.bench.prefill_attention [--threads 2] [--dtype bfloat16]
        [--clock wall|thread] [--paths portable avx2]

Shapes default to SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64); each
workload is one layer of a prefill step (no cache: whole prompts only): `BATCHxLENGTH` prompts
of one length, or `BATCHxLO-HI` prompts of random lengths in [LO, HI] (seeded), where the torch
backend pads or splits. Times are best of `--repeats`, scaled to `--layers` layers. With
`--paths`, the kernel is timed on each of those paths (`pagoda_kernels.cpu.prefill_paths()`)
instead of the fastest one alone.
"""
import argparse
import itertools
import random
import time

import torch

from ops.bench.timing import best_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["64x128", "8x1024", "16x16-512"],
                        help="BATCHxLENGTH or BATCHxLO-HI prompts per step")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="thread: CPU time of the calling thread, which a busy machine "
                             "inflates less than wall time (with --threads 1 it is all the "
                             "work)")
    parser.add_argument("--paths", nargs="+", default=None,
                        help="time the kernel on each of these paths (default: the fastest)")
    args = parser.parse_args()

    from pagoda_kernels import cpu
    from services.worker.attention.base import AttentionMetadata
    from services.worker.attention.cpu_backend import CpuAttentionBackend
    from services.worker.attention.torch_backend import TorchAttentionBackend

    unknown = set(args.paths or []) - set(cpu.prefill_paths())
    if unknown:
        parser.error(f"--paths: {sorted(unknown)} do not run here; this build runs "
                     f"{cpu.prefill_paths()}")
    if args.paths and not cpu.prefill_simd_path():
        parser.error("--paths: without a vector loop the backend leaves prompts to torch")
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(f"threads {args.threads}, heads {args.heads}/{args.kv_heads}, head_dim "
          f"{args.head_dim}, paths {cpu.prefill_paths()}; {args.clock} ms per layer "
          f"(x{args.layers} layers)")
    g = torch.Generator().manual_seed(0)
    for dtype_name, workload in itertools.product(args.dtype, args.workloads):
        dtype = getattr(torch, dtype_name)
        batch, span = workload.split("x")
        lo, _, hi = span.partition("-")
        rng = random.Random(0)
        lengths = [rng.randint(int(lo), int(hi or lo)) for _ in range(int(batch))]
        tokens = sum(lengths)
        q = torch.randn(tokens, args.heads, args.head_dim, generator=g).to(dtype)
        k = torch.randn(tokens, args.kv_heads, args.head_dim, generator=g).to(dtype)
        v = torch.randn(tokens, args.kv_heads, args.head_dim, generator=g).to(dtype)
        lens = torch.tensor(lengths, dtype=torch.int64)
        meta = AttentionMetadata(
            num_prefills=len(lengths), num_prefill_tokens=tokens, num_decode_tokens=0,
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            query_start_loc=torch.tensor(list(itertools.accumulate(lengths, initial=0))),
            seq_lens=lens, context_lens=torch.zeros_like(lens),
            block_tables=torch.zeros(len(lengths), 0, dtype=torch.int64),
            max_query_len=max(lengths), max_seq_len=max(lengths), block_size=16,
            seq_lens_list=lengths, query_lens_list=lengths)
        scale = args.head_dim ** -0.5
        backend, torch_backend = CpuAttentionBackend(), TorchAttentionBackend()

        def kernel_on(path: str) -> torch.Tensor:
            cpu.set_prefill_path(path)
            return backend.forward(q, k, v, None, None, meta, scale)

        ops = {f"kernel/{p}": (lambda p=p: kernel_on(p)) for p in args.paths or ["amx"]}
        ops["torch"] = lambda: torch_backend.forward(q, k, v, None, None, meta, scale)
        times = {name: float("inf") for name in ops}
        try:
            for _ in range(2):  # alternate, so that a busy moment does not favour one side
                for name, op in ops.items():
                    times[name] = min(times[name],
                                      1e3 * best_seconds(op, args.repeats, clock))
        finally:
            cpu.set_prefill_path("amx")  # the default: the fastest path there is
        torch_ms = times.pop("torch")
        kernels = ", ".join(
            f"{name.removeprefix('kernel/') if args.paths else 'kernel'} {ms:7.1f} ms "
            f"({ms * args.layers / 1e3:5.2f} s, torch / it {torch_ms / ms:4.2f})"
            for name, ms in times.items())
        print(f"{dtype_name:9s} {workload:>9s}: {kernels}; torch {torch_ms:7.1f} ms "
              f"({torch_ms * args.layers / 1e3:5.2f} s)")


if __name__ == "__main__":
    main()
