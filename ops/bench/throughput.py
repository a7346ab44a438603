"""Offline throughput on random-token workloads, with optional baselines on the same prompts.

Reports requests/s, output and total tokens/s, and the fraction of the machine's matmul rate
that the model's FLOPs per token times total tokens/s reach (the best of several measurements of
that rate, see ops/bench/yardstick.py). Workloads (ops/bench/workloads.py, `--workloads fixed
mixed`): `fixed`, every prompt `--input-len` tokens; `mixed`, lengths drawn from
`--input-len-range`. Baselines in the same run: `--baseline hf` runs transformers' `generate`
with static, left-padded batches; `--baseline onednn` (fp32, CPU) runs pagoda a second time,
loaded beside the first, with its fp32 weights packed for oneDNN instead of the layout this
CPU chose (services/worker/models/linear.py, `fp32_layout`); `--baseline vllm --vllm-python
VENV/bin/python` runs vLLM's offline `LLM` in that interpreter (vLLM lives in its own venv;
the model is handed to it as a Hugging Face folder, exported from a GGUF file when that is what
pagoda serves). The systems load
once and take turns: each round runs every workload on every system, one run each, each round
led by the next system, so that a machine whose speed drifts slows them alike. `--repeats N`
runs N rounds, each on fresh prompts, and reports the median run per workload and system, and
each round's ratio beside the ratio of the medians.
"""
import argparse
import json
import platform
import statistics
import time

import torch

from ops.bench.workloads import WORKLOAD_NAMES, Workload, build_workloads, make_workload
from ops.bench.yardstick import Yardstick
from ops.bench.peers import HfRunner, VllmPeer, hf_folder_for
from ops.bench.processes import process_tree, process_tree_cpu_s, wait_until_idle

# Imported from here elsewhere.
__all__ = ["hf_folder_for", "make_workload", "process_tree", "process_tree_cpu_s"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shared.engine_args import EngineArgs
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 256],
                        metavar=("LOW", "HIGH"),
                        help="the `mixed` workload's prompt lengths: uniform in [LOW, HIGH]")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOAD_NAMES, default=["fixed"],
                        help="run each of these in every round: fixed (--num-prompts x "
                             "--input-len), mixed (--num-prompts x --input-len-range)")
    parser.add_argument("--baseline", nargs="+", choices=["none", "hf", "vllm", "onednn"],
                        default=["none"])
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vLLM installed (for --baseline vllm)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each workload this many times on each system, each time with "
                             "fresh prompts (so no prefix cache helps), and report the median; "
                             "on a noisy machine, the spread says how far one run can be trusted")
    parser.add_argument("--output-json", default=None, help="save the results here")
    parser.add_argument("--stack", action="store_true",
                        help="also run the workload through the ZMQ stack (pagoda serve's "
                             "processes, no HTTP) and compare with in-process")
    parser.add_argument("--tokenizers", type=int, default=1)
    EngineArgs.add_cli_args(parser)


class PagodaRunner:
    """pagoda's offline LLM in this process."""

    def __init__(self, engine_args, output_len: int, warmup: list[list[int]],
                 name: str = "pagoda"):
        from pagoda import LLM, SamplingParams
        self.name = name
        t0 = time.perf_counter()
        self.llm = LLM(**engine_args.to_dict())
        self.startup_s = time.perf_counter() - t0
        self.params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        self.llm.generate(prompt_token_ids=[p[:8] for p in warmup[:2]], sampling_params=(
            SamplingParams(max_tokens=2, ignore_eos=True)), use_tqdm=False)

    def run(self, prompts: list[list[int]]) -> tuple[float, int]:
        start = time.perf_counter()
        outputs = self.llm.generate(prompt_token_ids=prompts, sampling_params=self.params)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)

    def report(self) -> dict:
        model = self.llm.llm_engine.executor.worker.model_runner.model
        stats = self.llm.llm_engine.get_stats()
        # Step and preemption counts cover the warm-up and every run.
        return {"startup_s": self.startup_s,
                "num_params": sum(p.numel() for p in model.parameters()),
                "steps_all_runs": stats.num_steps, "preemptions_all_runs": stats.num_preemptions}

    def close(self) -> None:
        pass


def run_alternating(systems: list, workloads: list[Workload],
                    after_round=None) -> dict[str, dict[str, dict]]:
    """Round after round, every workload on every system in turn, so that drift in the
    machine's speed reaches all of them alike; each round starts with the next system, so that
    none always runs first. `after_round(i)` is called once round i has ended (every system
    idle). -> per workload, per system: every run's time, the output token count (of the last
    run) and the system's report."""
    results = {w.name: {s.name: {"runs_s": []} for s in systems} for w in workloads}
    for i in range(len(workloads[0].rounds)):
        for workload in workloads:
            for system in systems[i % len(systems):] + systems[:i % len(systems)]:
                seconds, n_out = system.run(workload.rounds[i])
                results[workload.name][system.name]["runs_s"].append(seconds)
                results[workload.name][system.name]["output_tokens"] = n_out
        if after_round is not None:
            after_round(i)
    for system in systems:
        report = system.report()
        for workload in workloads:
            measured = results[workload.name][system.name]
            measured.update({**report, **_timings(measured["runs_s"])})
    return results


def _timings(runs: list[float]) -> dict:
    """The median run is the figure; every run is kept."""
    return {"elapsed_s": statistics.median(runs), "runs_s": runs}


def run_stack(engine_args, workloads: list[Workload], output_len: int,
              tokenizers: int) -> dict[str, dict]:
    """The same workloads through real processes and sockets, submitted with
    AsyncEngineClient, one workload's rounds after the other -> per workload, what it measured."""
    import asyncio

    from ops.launcher import LocalStack
    from pagoda import AsyncEngineClient, SamplingParams
    from shared.sockets import probe_health

    t0 = time.perf_counter()
    with LocalStack(engine_args=engine_args.to_dict(), gateway=False, tokenizers=tokenizers) as stack:
        startup = time.perf_counter() - t0
        worker_ctl = stack.stack_config.control_for("worker", 0)
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)

        async def submit_all(batch, p):
            client = AsyncEngineClient(stack.stack_config, output_timeout_s=600)
            try:
                async def one(ids):
                    n = 0
                    async for out in client.generate(ids, p):
                        n += len(out.outputs[0].token_ids)
                    return n
                return await asyncio.gather(*(one(ids) for ids in batch))
            finally:
                client.close()

        asyncio.run(submit_all([p[:8] for p in workloads[0].rounds[0][:2]],
                               SamplingParams(max_tokens=2, ignore_eos=True)))
        results = {}
        for workload in workloads:
            before = probe_health(worker_ctl, 5).details
            runs = []
            for prompts in workload.rounds:
                start = time.perf_counter()
                counts = asyncio.run(submit_all(prompts, params))
                runs.append(time.perf_counter() - start)
            after = probe_health(worker_ctl, 5).details
            engine = probe_health(stack.stack_config.engine_control, 5).details
            busy = after["busy_s"] - before["busy_s"]
            idle = after["idle_s"] - before["idle_s"]
            results[workload.name] = {
                "startup_s": startup, **_timings(runs), "output_tokens": sum(counts),
                "worker_busy_s": busy, "worker_idle_s": idle,
                "worker_idle_fraction": idle / max(busy + idle, 1e-9),
                "worker_steps_all_runs": after["steps"] - before["steps"],
                "last_step_bytes": engine.get("last_step_bytes"), "tokenizers": tokenizers}
    return results


def run(args: argparse.Namespace) -> int:
    import os

    from shared.engine_args import EngineArgs
    from shared.tokenizer import get_tokenizer
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    tokenizer = get_tokenizer(config.model_config.tokenizer)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    workloads = build_workloads(args.workloads, config.model_config.vocab_size,
                                set(tokenizer.all_special_ids), args.num_prompts, args.input_len,
                                tuple(args.input_len_range), args.repeats, args.seed)
    dtype = config.model_config.dtype
    device = config.device_config.device
    if "onednn" in args.baseline:
        _check_onednn_baseline(dtype, device, engine_args)
    print(f"workloads: {'; '.join(f'{w.name}, {w.description}' for w in workloads)}; "
          f"{args.output_len} output tokens each, dtype {str(dtype).removeprefix('torch.')}, "
          f"device {device}" + (f", {args.repeats} rounds (median)" if args.repeats > 1 else ""))

    # The matmul rate is measured with nothing of the benchmark's running: before the baselines
    # start, and after every round (a peer is stopped between its runs; what still runs in this
    # process tree is waited out first).
    yardstick = Yardstick(dtype, device)
    yardstick.measure("before the systems start")

    def measure_after_round(i: int) -> None:
        wait_until_idle(os.getpid())
        yardstick.measure(f"after round {i + 1}")

    systems = [PagodaRunner(engine_args, args.output_len, workloads[0].rounds[0])]
    try:
        if "vllm" in args.baseline:
            systems.append(VllmPeer(args.vllm_python, config, args.output_len,
                                    [prompts for w in workloads for prompts in w.rounds]))
        if "hf" in args.baseline:
            systems.append(HfRunner(config.model_config, args.output_len, args.hf_batch_size))
        if "onednn" in args.baseline:
            systems.append(_onednn_runner(engine_args, args.output_len, workloads[0].rounds[0]))
        if len(systems) > 1:
            print(f"alternating runs: {', '.join(s.name for s in systems)}, one each per round")
        results = run_alternating(systems, workloads, measure_after_round)
    finally:
        for system in systems:
            system.close()
    stack = (run_stack(engine_args, workloads, args.output_len, args.tokenizers)
             if args.stack else {})

    result = {"workloads": {}, "output_len": args.output_len, "seed": args.seed,
              "repeats": args.repeats, "dtype": str(dtype).removeprefix("torch."),
              "device": str(device),
              "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
              **yardstick.summary(), "engine_args": engine_args.to_dict()}
    print(yardstick.describe())
    for workload in workloads:
        print(f"workload {workload.name}: {workload.description} x {args.output_len} output")
        result["workloads"][workload.name] = _report_workload(
            workload, results[workload.name], stack.get(workload.name), yardstick, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"saved {args.output_json}")
    return 0


def _check_onednn_baseline(dtype: torch.dtype, device: torch.device, engine_args) -> None:
    """--baseline onednn runs only where it compares what it says: fp32 on the CPU, oneDNN's
    fp32 matmul in this torch, and the worker in this process (where the layout is set)."""
    from services.worker.models.linear import _onednn
    if dtype != torch.float32 or device.type != "cpu":
        raise SystemExit("--baseline onednn compares fp32 weight layouts on the CPU: it needs "
                         "--dtype float32 and the cpu device")
    if not _onednn(torch.float32):
        raise SystemExit("--baseline onednn: this torch has no oneDNN fp32 matmul")
    if engine_args.tensor_parallel_size > 1:
        raise SystemExit("--baseline onednn sets the layout in this process: it needs "
                         "--tensor-parallel-size 1")


def _onednn_runner(engine_args, output_len: int, warmup: list[list[int]]) -> PagodaRunner:
    """pagoda again, its fp32 weights packed for oneDNN whatever this CPU's layout is."""
    from services.worker.models import linear
    chosen = linear.fp32_layout()
    linear.set_fp32_layout("onednn")
    try:
        return PagodaRunner(engine_args, output_len, warmup, name="onednn")
    finally:
        linear.set_fp32_layout(chosen)


def _report_workload(workload: Workload, results: dict[str, dict], stack: dict | None,
                     yardstick: Yardstick, args: argparse.Namespace) -> dict:
    """One workload's figures, printed -> its part of the JSON result."""
    for measured in results.values():
        measured.update(_rates(measured, workload.num_prompts, workload.input_tokens))
    result = {"workload": {**workload.summary(), "output_len": args.output_len}}
    r = result["pagoda"] = results["pagoda"]
    flops_per_token = 2 * r["num_params"]
    r["fraction_of_matmul_peak"] = yardstick.fraction(flops_per_token * r["total_tok_s"])
    _print("pagoda", r)
    print(f"  model {flops_per_token / 1e9:.3f} GFLOP/token; matmul {yardstick.best:.0f} GFLOP/s "
          f"-> {yardstick.best * 1e9 / flops_per_token:.0f} tok/s at peak; pagoda reaches "
          f"{100 * r['fraction_of_matmul_peak']:.1f}% of it")

    if stack is not None:
        stack.update(_rates(stack, workload.num_prompts, workload.input_tokens))
        result["stack"] = stack
        _print(f"pagoda stack ({args.tokenizers} tokenizer(s), ZMQ processes)", stack)
        result["ratio_stack_vs_inprocess"] = stack["output_tok_s"] / r["output_tok_s"]
        print(f"  stack / in-process (output tok/s): {result['ratio_stack_vs_inprocess']:.3f}; "
              f"worker idle between forward passes: {100 * stack['worker_idle_fraction']:.2f}% "
              f"of step time over {stack['worker_steps_all_runs']} steps")

    if "vllm" in results:
        v = result["vllm"] = results["vllm"]
        _print(f"vLLM {v['version']} (its offline LLM, started in {v['startup_s']:.0f} s)", v)
        print(_compare(result, "vllm", "vLLM", "ratio_vs_vllm_output_tok_s",
                       "ratio_vs_vllm_by_round")
              + (f"; stack / vLLM: {stack['output_tok_s'] / v['output_tok_s']:.2f}x"
                 if stack is not None else ""))

    if "onednn" in results:
        result["onednn"] = results["onednn"]
        _print("pagoda, fp32 weights packed for oneDNN", results["onednn"])
        print(_compare(result, "onednn", "pagoda on oneDNN", "ratio_vs_onednn_output_tok_s",
                       "ratio_vs_onednn_by_round"))

    if "hf" in results:
        result["hf"] = results["hf"]
        _print(f"transformers (static batches of {args.hf_batch_size})", results["hf"])
        print(_compare(result, "hf", "transformers", "ratio_output_tok_s", "ratio_by_round"))
    return result


def _compare(result: dict, baseline: str, label: str, ratio_key: str, rounds_key: str) -> str:
    """pagoda against a baseline in `result`: the ratio of the medians and each round's ratio,
    stored under the given keys -> the line that reports them."""
    r, b = result["pagoda"], result[baseline]
    result[ratio_key] = r["output_tok_s"] / b["output_tok_s"]
    result[rounds_key] = _round_ratios(r, b)
    return (f"ratio pagoda / {label} (output tok/s): {result[ratio_key]:.2f}x"
            + _by_round(result[rounds_key]))


def _round_ratios(pagoda: dict, baseline: dict) -> list[float]:
    """pagoda's output tok/s over the baseline's, round by round (the same prompts, run one
    after the other)."""
    return [(pagoda["output_tokens"] / p) / (baseline["output_tokens"] / b)
            for p, b in zip(pagoda["runs_s"], baseline["runs_s"])]


def _by_round(ratios: list[float]) -> str:
    return (f" (by round: {', '.join(f'{x:.2f}' for x in ratios)}; median "
            f"{statistics.median(ratios):.2f}x)" if len(ratios) > 1 else "")


def _rates(r: dict, num_prompts: int, total_in: int) -> dict:
    t = r["elapsed_s"]
    return {"requests_s": num_prompts / t, "output_tok_s": r["output_tokens"] / t,
            "total_tok_s": (r["output_tokens"] + total_in) / t}


def _print(name: str, r: dict) -> None:
    runs = r.get("runs_s", [])
    spread = (f" (runs: {', '.join(f'{t:.2f}' for t in runs)} s)" if len(runs) > 1 else "")
    print(f"{name}: {r['elapsed_s']:.2f} s, {r['requests_s']:.2f} req/s, "
          f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s{spread}")
