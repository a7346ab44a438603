"""Tensor and data parallelism against one rank and one replica, in the same run.

`pagoda bench parallel --rounds 2 [engine flags]` runs `pagoda bench throughput` (its fixed
workload, one repeat) as a fresh process per configuration, in alternating order each round:
offline with --tensor-parallel-size 1 and N, and through the stack (`--stack`, ZMQ processes,
no HTTP) with --data-parallel-size 1 and K. It reports each configuration's output tok/s per
round, the medians, and the ratios TP N / TP 1 and DP K / DP 1 by round.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=2, metavar="N",
                        help="the tensor-parallel size compared with 1 (offline)")
    parser.add_argument("--data-parallel", type=int, default=2, metavar="K",
                        help="the data-parallel size compared with 1 (through the stack)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("engine_flags", nargs=argparse.REMAINDER,
                        help="passed on to every `pagoda bench throughput` (e.g. --dtype bfloat16)")


def _configurations(args) -> list[tuple[str, list[str], str]]:
    """(name, flags, which figure of the throughput result: in-process or stack)."""
    n, k = args.tensor_parallel, args.data_parallel
    return [("TP 1 offline", ["--tensor-parallel-size", "1"], "pagoda"),
            (f"TP {n} offline", ["--tensor-parallel-size", str(n)], "pagoda"),
            ("DP 1 stack", ["--stack", "--data-parallel-size", "1"], "stack"),
            (f"DP {k} stack", ["--stack", "--data-parallel-size", str(k)], "stack")]


def _run_one(args, flags: list[str], figure: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "pagoda", "bench", "throughput", "--baseline", "none",
               "--repeats", "1", "--workloads", "fixed", "--num-prompts", str(args.num_prompts),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--output-json", out, *flags, *args.engine_flags]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return float(json.load(f)["workloads"]["fixed"][figure]["output_tok_s"])


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    configs = _configurations(args)
    runs: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]  # who goes first alternates
        for name, flags, figure in order:
            runs[name].append(_run_one(args, flags, figure))
            print(f"round {r + 1}: {name}: {runs[name][-1]:.1f} output tok/s", flush=True)
    names = [name for name, _, _ in configs]
    summary = {"runs": runs, "medians": {n: statistics.median(v) for n, v in runs.items()},
               "cpus": len(os.sched_getaffinity(0)), "engine_flags": args.engine_flags,
               "workload": f"{args.num_prompts} x {args.input_len} -> {args.output_len}"}
    for base, other in ((names[0], names[1]), (names[2], names[3])):
        ratios = [o / b for o, b in zip(runs[other], runs[base])]
        summary[f"{other} / {base}"] = ratios
        print(f"{other} / {base}: by round {', '.join(f'{x:.2f}' for x in ratios)}; medians "
              f"{summary['medians'][other]:.1f} / {summary['medians'][base]:.1f} output tok/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0
