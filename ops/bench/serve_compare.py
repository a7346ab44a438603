"""`pagoda bench serve --baseline vllm | pagoda`: the benchmark starts the servers itself, one at
a time (the other fully stopped), and runs the same client on the same prompts against each.

Each round starts every system fresh in turn, the next round led by the next system. Per system
and round: ready, one short warm-up request, the first pass (the main workload), `--warm-passes`
more passes, then each `--extra-workload` once, then stop. Pass k of the main workload draws its
prompts from seed + k, so both systems get the same prompts at the same pass and no pass meets
another's prefix cache. Each pass keeps its summary, the CPU seconds of each server process
(by role) and of the client, and for pagoda the worker's busy, idle and step counts.
"""
import argparse
import asyncio
import json
import os
import shlex
import resource
import tempfile
import time
from dataclasses import dataclass, fields

from ops.bench.processes import cpu_delta_by_role
from ops.bench.serve_client import (make_client, make_prompts, new_result_dir, print_summary,
                                    run_at_rate, run_vllm_bench, summarize, vllm_command)
from ops.bench.serve_report import build_report, cpu_line, figures, print_report, worker_line

SKIPPED_ENGINE_FLAGS = ("model", "tokenizer", "seed")  # bench serve has its own of these


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """EngineArgs' flags for the servers the benchmark starts; unset ones stay None, so each
    server keeps its own defaults (--model and --tokenizer are the benchmark's own)."""
    from shared.engine_args import EngineArgs, _cli_type
    group = parser.add_argument_group("engine (the servers --baseline starts)")
    for f in fields(EngineArgs):
        if f.name in SKIPPED_ENGINE_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata.get("help")
        text = text.replace("%(default)s", str(f.default)) if text else None
        if f.type in (bool, "bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        else:
            group.add_argument(flag, type=_cli_type(f.type), default=None, help=text)


def user_engine_args(args: argparse.Namespace) -> dict:
    from shared.engine_args import EngineArgs
    out = {f.name: getattr(args, f.name, None) for f in fields(EngineArgs)
           if f.name not in SKIPPED_ENGINE_FLAGS}
    out = {k: v for k, v in out.items() if v is not None}
    if args.model:
        out["model"] = args.model
    if args.tokenizer:
        out["tokenizer"] = args.tokenizer
    return out


@dataclass
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int


def parse_workload(text: str) -> Workload:
    """'64x1024x64' -> 64 prompts x 1024 input x 64 output tokens."""
    try:
        n, i, o = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--extra-workload {text!r}: expected NxINxOUT, e.g. 64x1024x64")
    if min(n, i, o) < 1:
        raise SystemExit(f"--extra-workload {text!r}: every number must be at least 1")
    return Workload(f"{n}x{i}x{o}", n, i, o)


@dataclass
class PassPlan:
    workload: Workload
    index: int  # 0: the first pass; 1..: warm passes (extra workloads: 0 only)
    seed: int

    @property
    def kind(self) -> str:
        return "first" if self.index == 0 else "warm"


def plan_passes(main: Workload, warm_passes: int, extras: list[Workload],
                seed: int) -> list[PassPlan]:
    """The passes of one system in one round, in order; the seeds differ between passes and
    workloads and repeat between systems and rounds."""
    plan = [PassPlan(main, k, seed + k) for k in range(1 + warm_passes)]
    plan += [PassPlan(w, 0, seed + 1000 * (j + 1)) for j, w in enumerate(extras)]
    return plan


def round_order(systems: list[str], round_index: int) -> list[str]:
    """Round r is led by system r mod n."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def _vllm_settings(engine_args: dict, config, served_name: str) -> dict:
    space = config.cache_config.kv_cache_space_gib
    return {"dtype": str(config.model_config.dtype).removeprefix("torch."),
            "max_model_len": config.model_config.max_model_len,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            # vLLM reads whole GiB
            "kv_cache_space_gib": max(1, round(space)) if space is not None else None,
            "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
            "max_num_batched_tokens": engine_args.get("max_num_batched_tokens"),
            "enable_prefix_caching": engine_args.get("enable_prefix_caching"),
            "device": config.device_config.device.type, "served_model_name": served_name}


def run(args: argparse.Namespace) -> int:
    from shared.config import ConfigError
    from shared.engine_args import EngineArgs
    from shared.model_source import DEFAULT_MODEL_NAME
    from ops.bench.serve_servers import PagodaServer, VllmServer
    rates = [float(r) for r in args.request_rate]
    if len(rates) != 1 or not rates[0] > 0:
        raise SystemExit("--baseline runs one --request-rate (positive, or inf)")
    rate = rates[0]
    if args.rounds < 1 or args.warm_passes < 0:
        raise SystemExit("--rounds must be at least 1 and --warm-passes at least 0")
    systems = ["pagoda", "vllm"] if args.baseline == "vllm" else ["pagoda"]
    needs_vllm = "vllm" in systems or args.client == "vllm"
    if needs_vllm and not (args.vllm_python and os.access(args.vllm_python, os.X_OK)):
        raise SystemExit("--baseline vllm and --client vllm need --vllm-python: the Python of a "
                         "venv with vLLM (e.g. /work/vllm-venv/bin/python)")
    engine_args = user_engine_args(args)
    try:
        config = EngineArgs(**engine_args).create_engine_config()
    except ConfigError as e:
        raise SystemExit(f"pagoda bench serve: {e}")
    folder = None
    if needs_vllm:
        from ops.bench.throughput import hf_folder_for
        folder = hf_folder_for(config.model_config)
    served = os.path.basename(args.model.rstrip("/")) if args.model else DEFAULT_MODEL_NAME
    vllm_settings = _vllm_settings(engine_args, config, served)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="pagoda-bench-")
    os.makedirs(run_dir, exist_ok=True)

    main = Workload("main", args.num_prompts, args.input_len, args.output_len)
    extras = [parse_workload(t) for t in args.extra_workload]
    plan = plan_passes(main, args.warm_passes, extras, args.seed)
    tokenizer = args.tokenizer or config.model_config.tokenizer
    prompts = {(p.workload.name, p.index): make_prompts(
        tokenizer, p.workload.num_prompts, p.workload.input_len, p.seed) for p in plan}
    warmup = make_prompts(tokenizer, 1, 8, args.seed + 999_999)[0]
    print(f"managed comparison: {', '.join(systems)}; {args.rounds} round(s), each: warm-up, "
          f"first pass + {args.warm_passes} warm pass(es) of {main.num_prompts} x "
          f"{main.input_len} -> {main.output_len}"
          + (f", then {', '.join(w.name for w in extras)}" if extras else "")
          + f"; rate {args.request_rate[0]}, concurrency {args.max_concurrency or 'unlimited'}, "
          f"client {args.client}; logs in {run_dir}", flush=True)

    passes, servers_info = [], []
    for r in range(args.rounds):
        for system in round_order(systems, r):
            tag = f"r{r}"
            server = (PagodaServer(engine_args, run_dir, tag, shlex.split(args.pagoda_serve_args))
                      if system == "pagoda"
                      else VllmServer(args.vllm_python, folder, vllm_settings, run_dir, tag))
            print(f"[round {r}] {system}: starting ({' '.join(server.command[:4])} ...)",
                  flush=True)
            try:
                server.start()
                ready_s = server.wait_ready(args.startup_timeout)
                print(f"[round {r}] {system}: ready in {ready_s:.0f} s", flush=True)
                servers_info.append({"system": system, "round": r, "ready_s": ready_s,
                                     "pid": server.proc.pid, "command": server.command,
                                     "env": {k: v for k, v in server.env.items()
                                             if k.startswith("VLLM_")},
                                     "log": server.log_path})
                for p in run_system_passes(args, server, plan, prompts, warmup, rate, folder,
                                           run_dir):
                    passes.append({"system": system, "round": r, **p})
            finally:
                t0 = time.monotonic()
                server.stop()
                print(f"[round {r}] {system}: stopped in {time.monotonic() - t0:.1f} s",
                      flush=True)

    report = build_report(passes, systems)
    print_report(report, systems)
    result = {"mode": "managed", "systems": systems, "rounds": args.rounds,
              "warm_passes": args.warm_passes, "client": args.client,
              "request_rate": args.request_rate[0], "max_concurrency": args.max_concurrency,
              "engine_args": engine_args, "vllm_settings": vllm_settings if "vllm" in systems
              else None, "workloads": {w.name: vars(w) for w in [main, *extras]},
              "seed": args.seed, "servers": servers_info, "report": report, "passes": passes,
              "run_dir": run_dir}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"saved {args.output_json}")
    failed = sum(p["summary"].get("failed") or 0 for p in passes)
    return 1 if failed else 0


def run_system_passes(args, server, plan: list[PassPlan], prompts: dict, warmup: list[int],
                      rate: float, folder: str | None, run_dir: str) -> list[dict]:
    """The warm-up and every pass of the plan on one running server -> one record per pass."""
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY") or "none"
    concurrency = args.max_concurrency or max(w.workload.num_prompts for w in plan)

    async def main() -> list[dict]:
        client = make_client("httpx" if args.client == "vllm" else args.client, server.base_url,
                             api_key, concurrency, args.timeout)
        try:
            model = await client.model()
            await warm_up(client, model, warmup, args.startup_timeout)
            records = []
            for p in plan:
                records.append(await one_pass(p, client, model))
            return records
        finally:
            await client.close()

    async def one_pass(p: PassPlan, client, model: str) -> dict:
        w = p.workload
        health_before = server.health()
        cpu_before = server.cpu_snapshot()
        self_before = resource.getrusage(resource.RUSAGE_SELF)
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        if args.client == "vllm":
            result_dir = new_result_dir(run_dir)
            command = vllm_command(args.vllm_python, server.base_url, model, folder,
                                   w.num_prompts, w.input_len, w.output_len, rate,
                                   args.max_concurrency, p.seed, result_dir)
            summary = await asyncio.to_thread(
                run_vllm_bench, command, result_dir, rate,
                os.path.join(run_dir, "vllm-bench.log"), args.timeout * 4)
        else:
            results, duration = await run_at_rate(client, model, prompts[(w.name, p.index)],
                                                  w.output_len, rate, p.seed,
                                                  args.max_concurrency)
            summary = summarize(rate, results, duration, w.input_len)
        cpu = cpu_delta_by_role(cpu_before, server.cpu_snapshot())
        self_after = resource.getrusage(resource.RUSAGE_SELF)
        children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cpu = _cpu(self_after) - _cpu(self_before)
        if args.client == "vllm":  # vLLM's bench serve, start-up included
            client_cpu = _cpu(children_after) - _cpu(children_before)
        record = {"workload": w.name, "pass": p.index, "kind": p.kind, "seed": p.seed,
                  "summary": summary, "figures": figures(summary), "cpu_s": cpu,
                  "client_cpu_s": client_cpu}
        health_after = server.health()
        if health_before and health_after:
            delta = {k: health_after[k] - health_before[k] for k in health_before
                     if isinstance(health_before[k], (int, float))
                     and isinstance(health_after[k], (int, float))}
            if delta.get("steps"):
                delta["busy_ms_per_step"] = 1000 * delta.get("busy_s", 0) / delta["steps"]
                delta["idle_ms_per_step"] = 1000 * delta.get("idle_s", 0) / delta["steps"]
            record["worker"] = delta
        print(f"  {server.name} {w.name} pass {p.index} ({p.kind}):", flush=True)
        print_summary(summary)
        print(f"  CPU s: {cpu_line({**cpu, 'client': client_cpu})}"
              + (f"; worker {worker_line(record['worker'])}" if record.get("worker") else ""),
              flush=True)
        return record

    return asyncio.run(main())


async def warm_up(client, model: str, prompt: list[int], timeout_s: float) -> None:
    """One short request (a fresh server's first pays for warm-up), repeated while the server
    answers that it is still starting."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await client.send(model, prompt, 2)
        if result.ok:
            return
        if "503" not in result.error or time.monotonic() > deadline:
            raise RuntimeError(f"the warm-up request failed: {result.error}")
        await asyncio.sleep(1.0)


def _cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime
