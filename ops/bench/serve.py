"""Serving benchmark: random-token prompts streamed through the HTTP API at Poisson request rates.

For each `--request-rate` (requests/s; `inf` sends them all at once; `--max-concurrency` caps the
requests in flight) it reports request and output-token throughput, time to first token (TTFT),
time per output token after the first (TPOT), inter-token latency (ITL, the gaps between stream
chunks) and end-to-end latency: mean, p50, p90, p99 in milliseconds. Prompts are token ids with
`ignore_eos`, so every request reads `--input-len` tokens and writes `--output-len`. The client
(ops/bench/serve_client.py): `--client httpx` (lean, the default), `openai` (the official
library), or `vllm` (vLLM's own `bench serve`, run by `--vllm-python`).

Against a running server (`--base-url`), or, with `--baseline vllm` (or `pagoda`, alone), on
servers the benchmark starts and stops itself, one at a time, in alternating rounds with warm
passes and extra workloads: see ops/bench/serve_compare.py.
"""
import argparse
import asyncio
import json
import os
import resource

from ops.bench.serve_client import (CLIENTS, make_client, make_prompts, new_result_dir,
                                    print_summary, run_at_rate, run_vllm_bench, summarize,
                                    vllm_command)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the gateway (without /v1)")
    parser.add_argument("--model", default=None,
                        help="the model name requests use (default: the first of /v1/models); "
                             "with --baseline, the model both servers load")
    parser.add_argument("--api-key", default=None, help="default: $PAGODA_API_KEY")
    parser.add_argument("--request-rate", nargs="+", default=["inf"],
                        help="requests per second, one run per value; inf = all at once")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer for the vocabulary (default: the default model's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output-json", default=None, help="save the results here")
    parser.add_argument("--plot", default=None, help="save a PNG plot here")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight (default: no limit)")
    parser.add_argument("--client", choices=CLIENTS, default="httpx",
                        help="httpx: lean streaming client (default); openai: the official "
                             "library; vllm: vLLM's own `bench serve` (needs --vllm-python)")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vLLM (for --baseline vllm, --client vllm)")
    managed = parser.add_argument_group(
        "managed servers (--baseline): the benchmark starts and stops each server itself")
    managed.add_argument("--baseline", choices=["vllm", "pagoda"], default=None,
                         help="vllm: pagoda serve and vllm serve in alternating rounds; "
                              "pagoda: pagoda serve alone; --base-url is then unused")
    managed.add_argument("--rounds", type=int, default=2,
                         help="each round starts each system fresh, led by the next system")
    managed.add_argument("--warm-passes", type=int, default=2,
                         help="passes after the first, each on fresh prompts")
    managed.add_argument("--extra-workload", nargs="*", default=[], metavar="NxINxOUT",
                         help="once per system and round after the main passes, e.g. "
                              "64x1024x64 256x32x32")
    managed.add_argument("--run-dir", default=None,
                         help="the servers' logs and run folders (default: a new /tmp folder)")
    managed.add_argument("--startup-timeout", type=float, default=600.0,
                         help="seconds a server has to answer /v1/models")
    managed.add_argument("--pagoda-serve-args", default="",
                         help="more `pagoda serve` flags, in one string (e.g. \"--worker-cpus "
                              "0-13 --service-cpus 14-15\")")
    from ops.bench.serve_compare import add_engine_arguments
    add_engine_arguments(parser)


def save_plot(path: str, summaries: list[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [str(s["request_rate"]) for s in summaries]
    x = list(range(len(summaries)))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
              ("e2e_latency_ms", "end-to-end latency"))
    for ax, (key, name) in zip(axes, panels):
        for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [s[key][p] if s[key][p] is not None else float("nan") for s in summaries],
                    style, label=p)
        ax.set_title(f"{name} (ms)")
        ax.set_ylabel("ms")
    axes[3].plot(x, [s["output_throughput"] for s in summaries], "o-", label="output tok/s")
    axes[3].set_title("output throughput (tok/s)")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _bench(args: argparse.Namespace, rates: list[float], prompts: list[list[int]]) -> dict:
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY") or "none"
    client = make_client(args.client, args.base_url, api_key,
                         args.max_concurrency or len(prompts), args.timeout)
    try:
        model = args.model or await client.model()
        # One short request first: the first request of a fresh stack pays for warm-up.
        await client.send(model, prompts[0][:8], 2)
        summaries = []
        for i, rate in enumerate(rates):
            before = resource.getrusage(resource.RUSAGE_SELF)
            results, duration = await run_at_rate(client, model, prompts, args.output_len, rate,
                                                  args.seed + i, args.max_concurrency)
            after = resource.getrusage(resource.RUSAGE_SELF)
            summary = summarize(rate, results, duration, args.input_len)
            summary["client_cpu_s"] = (after.ru_utime + after.ru_stime
                                       - before.ru_utime - before.ru_stime)
            print_summary(summary)
            print(f"  client CPU {summary['client_cpu_s']:.2f} s ({args.client})")
            summaries.append(summary)
    finally:
        await client.close()
    return {"model": model, "base_url": args.base_url, "client": args.client,
            "summaries": summaries}


def _bench_with_vllm_client(args: argparse.Namespace, rates: list[float]) -> dict:
    """vLLM's `bench serve` against the running server, one run per rate (its own prompts)."""
    import httpx
    from ops.bench.throughput import hf_folder_for
    from shared.engine_args import EngineArgs
    if not (args.vllm_python and os.access(args.vllm_python, os.X_OK)):
        raise SystemExit("--client vllm needs --vllm-python: the Python of a venv with vLLM")
    models = httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=30).json()
    model = args.model or models["data"][0]["id"]
    tokenizer = args.tokenizer or hf_folder_for(
        EngineArgs().create_engine_config().model_config)
    summaries = []
    for i, rate in enumerate(rates):
        result_dir = new_result_dir()
        command = vllm_command(args.vllm_python, args.base_url, model, tokenizer,
                               args.num_prompts, args.input_len, args.output_len, rate,
                               args.max_concurrency, args.seed + i, result_dir)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary = run_vllm_bench(command, result_dir, rate,
                                 os.path.join(result_dir, "vllm-bench.log"), args.timeout * 4)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary["client_cpu_s"] = (after.ru_utime + after.ru_stime
                                   - before.ru_utime - before.ru_stime)  # its start-up included
        print_summary(summary)
        summaries.append(summary)
    return {"model": model, "base_url": args.base_url, "client": "vllm", "summaries": summaries}


def run(args: argparse.Namespace) -> int:
    from ops.bench import serve_compare
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be at least 1")
    if args.baseline:
        return serve_compare.run(args)
    unused = sorted(set(serve_compare.user_engine_args(args)) - {"model", "tokenizer"})
    if unused:
        raise SystemExit(f"engine flags ({', '.join(unused)}) configure the servers that "
                         "--baseline starts; against --base-url they would change nothing")
    rates = [float(r) for r in args.request_rate]
    if any(not r > 0 for r in rates):
        raise SystemExit("--request-rate values must be positive (or inf)")
    prompts = make_prompts(args.tokenizer, args.num_prompts, args.input_len, args.seed)
    print(f"workload: {args.num_prompts} prompts x {args.input_len} input x {args.output_len} "
          f"output tokens; rates {', '.join(args.request_rate)} req/s; {args.base_url}")
    result = (_bench_with_vllm_client(args, rates) if args.client == "vllm"
              else asyncio.run(_bench(args, rates, prompts)))
    result["workload"] = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                          "output_len": args.output_len, "seed": args.seed}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {args.output_json}")
    if args.plot:
        save_plot(args.plot, result["summaries"],
                  f"pagoda serving: {result['model']}, {args.num_prompts} prompts, "
                  f"{args.input_len} in / {args.output_len} out")
        print(f"saved {args.plot}")
    failed = sum(s["failed"] for s in result["summaries"])
    return 1 if failed else 0
