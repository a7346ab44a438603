"""Serving benchmark: random-token prompts streamed through the HTTP API at Poisson request rates.

For each `--request-rate` (requests/s; `inf` sends them all at once) it reports request and
output-token throughput, time to first token (TTFT), time per output token after the first
(TPOT), inter-token latency (ITL, the gaps between stream chunks) and end-to-end latency: mean,
p50, p90, p99 in milliseconds. Prompts are token ids with `ignore_eos`, so every request reads
`--input-len` tokens and writes `--output-len`.
"""
import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the gateway (without /v1)")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
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


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0  # seconds to the first token
    latency: float = 0.0  # seconds to the last byte
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between token-bearing chunks

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def make_prompts(tokenizer_path: str | None, num_prompts: int, input_len: int,
                 seed: int) -> list[list[int]]:
    from ops.bench.throughput import make_workload
    from shared.tokenizer import get_tokenizer
    tokenizer = get_tokenizer(tokenizer_path)
    return make_workload(len(tokenizer), set(tokenizer.all_special_ids), num_prompts,
                         input_len, seed)


async def send_request(client, model: str, prompt: list[int], output_len: int,
                       timeout: float) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            timeout=timeout)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    result.ttft = now - result.start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - result.start
        result.ok = last is not None
        if not result.ok:
            result.error = "no tokens streamed"
    except Exception as e:  # one failed request is a data point, not the end of the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_at_rate(client, model: str, prompts: list[list[int]], output_len: int, rate: float,
                      seed: int, timeout: float) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(send_request(client, model, prompt, output_len, timeout)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation between closest ranks
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return {"mean": 1000 * statistics.fmean(ordered), "p50": 1000 * pct(50),
            "p90": 1000 * pct(90), "p99": 1000 * pct(99)}


def summarize(rate: float, results: list[RequestResult], duration: float, input_len: int) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + input_len * len(done)) / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "tpot_ms": _stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": _stats_ms([r.latency for r in done]),
    }


def print_summary(s: dict) -> None:
    print(f"--- request rate {s['request_rate']} req/s: {s['completed']} done, "
          f"{s['failed']} failed in {s['duration_s']:.1f} s")
    if s["errors"]:
        print(f"  errors: {s['errors']}")
    print(f"  request throughput {s['request_throughput']:.3f} req/s, output "
          f"{s['output_throughput']:.1f} tok/s, total {s['total_token_throughput']:.1f} tok/s")
    print(f"  {'(ms)':8} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_latency_ms", "E2E")):
        row = s[key]
        cells = "".join(f"{row[p]:>11.1f}" if row[p] is not None else f"{'-':>11}"
                        for p in ("mean", "p50", "p90", "p99"))
        print(f"  {name:8}{cells}")


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
    import openai
    api_key = args.api_key or os.environ.get("PAGODA_API_KEY") or "none"
    client = openai.AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=api_key,
                                max_retries=0, timeout=args.timeout)
    async with client:
        model = args.model or (await client.models.list()).data[0].id
        # One short request first: the first request of a fresh stack pays for warm-up.
        await send_request(client, model, prompts[0][:8], 2, args.timeout)
        summaries = []
        for i, rate in enumerate(rates):
            results, duration = await run_at_rate(client, model, prompts, args.output_len, rate,
                                                  args.seed + i, args.timeout)
            summary = summarize(rate, results, duration, args.input_len)
            print_summary(summary)
            summaries.append(summary)
    return {"model": model, "base_url": args.base_url, "summaries": summaries}


def run(args: argparse.Namespace) -> int:
    rates = [float(r) for r in args.request_rate]
    if any(not r > 0 for r in rates):
        raise SystemExit("--request-rate values must be positive (or inf)")
    prompts = make_prompts(args.tokenizer, args.num_prompts, args.input_len, args.seed)
    print(f"workload: {args.num_prompts} prompts x {args.input_len} input x {args.output_len} "
          f"output tokens; rates {', '.join(args.request_rate)} req/s; {args.base_url}")
    result = asyncio.run(_bench(args, rates, prompts))
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
