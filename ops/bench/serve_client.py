"""The serving benchmark's client and statistics: random-token prompts streamed to
/v1/completions (`ignore_eos`, so each request writes exactly its output length), one
`RequestResult` per request, and the summary of a pass.

Two clients of our own measure the same things: `httpx` (the default) streams with one
`httpx.AsyncClient` and parses only the `data:` lines, so that the client takes little of the
CPU it shares with the server it measures; `openai` goes through the official library (its
response objects cost several times the CPU). `run_vllm_bench` runs vLLM's own `bench serve`
instead, and turns its saved result into the same summary.
"""
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass, field

CLIENTS = ("httpx", "openai", "vllm")


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

    def on_text(self, now: float, last: float | None) -> float:
        """A chunk with text arrived at `now` -> the new time of the last one."""
        if last is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - last)
        return now

    def finish(self, last: float | None, ended: bool = True) -> None:
        """The stream is over; `ended`: it reached its end marker (a stream cut off before it,
        say by a server that died, is a failure however many tokens it had)."""
        self.latency = time.perf_counter() - self.start
        if not self.error and not ended:
            self.error = "stream cut off before its end (the server closed it early)"
        self.ok = last is not None and not self.error
        if last is None and not self.error:
            self.error = "no tokens streamed"


async def read_sse_completion(lines: AsyncIterable[str], result: RequestResult
                              ) -> tuple[float | None, bool]:
    """A streamed completion's lines into `result` (text chunk times, usage, a stream error)
    -> (the time of the last text chunk or None, whether [DONE] came)."""
    last = None
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return last, True
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"stream error: {chunk['error']}"
            return last, False
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"]["completion_tokens"]
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            last = result.on_text(now, last)
    return last, False


def make_prompts(tokenizer_path: str | None, num_prompts: int, input_len: int,
                 seed: int) -> list[list[int]]:
    from ops.bench.throughput import make_workload
    from shared.tokenizer import get_tokenizer
    tokenizer = get_tokenizer(tokenizer_path)
    return make_workload(len(tokenizer), set(tokenizer.all_special_ids), num_prompts,
                         input_len, seed)


class HttpxClient:
    """Streams completions with httpx; json.loads only on `data:` lines."""

    def __init__(self, base_url: str, api_key: str, concurrency: int, timeout: float):
        import httpx
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=concurrency,
                                max_keepalive_connections=concurrency))

    async def model(self) -> str:
        response = await self.http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    async def send(self, model: str, prompt: list[int], output_len: int) -> RequestResult:
        result = RequestResult(start=time.perf_counter())
        last, ended = None, False
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:200]}"
                else:
                    last, ended = await read_sse_completion(response.aiter_lines(), result)
        except Exception as e:  # one failed request is a data point, not the end of the run
            result.error = f"{type(e).__name__}: {e}"
        result.finish(last, ended)
        return result

    async def close(self) -> None:
        await self.http.aclose()


class OpenaiClient:
    """Streams completions through the official openai library."""

    def __init__(self, base_url: str, api_key: str, concurrency: int, timeout: float):
        import httpx
        import openai
        self.client = openai.AsyncOpenAI(
            base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
            timeout=timeout, http_client=openai.DefaultAsyncHttpxClient(
                limits=httpx.Limits(max_connections=concurrency,
                                    max_keepalive_connections=concurrency)))

    async def model(self) -> str:
        return (await self.client.models.list()).data[0].id

    async def send(self, model: str, prompt: list[int], output_len: int) -> RequestResult:
        result = RequestResult(start=time.perf_counter())
        last, ended = None, False
        try:
            stream = await self.client.completions.create(
                model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    result.output_tokens = chunk.usage.completion_tokens
                    # The library ends a stream cut off before [DONE] silently; the usage
                    # chunk without choices comes last, just before [DONE].
                    ended = not chunk.choices
                if chunk.choices and chunk.choices[0].text:
                    last = result.on_text(now, last)
        except Exception as e:  # one failed request is a data point, not the end of the run
            result.error = f"{type(e).__name__}: {e}"
        result.finish(last, ended)
        return result

    async def close(self) -> None:
        await self.client.close()


def make_client(name: str, base_url: str, api_key: str, concurrency: int, timeout: float):
    cls = {"httpx": HttpxClient, "openai": OpenaiClient}[name]
    return cls(base_url, api_key, max(1, concurrency), timeout)


async def run_at_rate(client, model: str, prompts: list[list[int]], output_len: int, rate: float,
                      seed: int, max_concurrency: int | None = None
                      ) -> tuple[list[RequestResult], float]:
    """Every prompt, arriving as a Poisson process of `rate` per second (inf: all at once),
    at most `max_concurrency` in flight -> the results and the seconds the pass took."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(prompt):
        if gate is None:
            return await client.send(model, prompt, output_len)
        async with gate:
            return await client.send(model, prompt, output_len)
    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
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


def vllm_command(python: str, base_url: str, model: str, tokenizer: str, num_prompts: int,
                 input_len: int, output_len: int, rate: float, max_concurrency: int | None,
                 seed: int, result_dir: str) -> list[str]:
    """vLLM's `bench serve` on its random dataset (its own prompts, drawn from `seed`)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cli.py")
    command = [python, script, "bench", "serve", "--backend", "openai", "--base-url", base_url,
               "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", str(input_len),
               "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
               "--request-rate", "inf" if math.isinf(rate) else str(rate), "--ignore-eos",
               "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result",
               "--result-dir", result_dir, "--result-filename", "result.json"]
    if max_concurrency:
        command += ["--max-concurrency", str(max_concurrency)]
    return command


def summary_from_vllm(saved: dict, rate: float) -> dict:
    """vLLM's saved `bench serve` result in `summarize`'s shape."""
    def stats(metric: str) -> dict:
        p50 = saved.get(f"p50_{metric}_ms", saved.get(f"median_{metric}_ms"))
        return {"mean": saved.get(f"mean_{metric}_ms"), "p50": p50,
                "p90": saved.get(f"p90_{metric}_ms"), "p99": saved.get(f"p99_{metric}_ms")}
    completed = saved.get("completed", 0)
    failed = saved.get("failed", saved.get("num_prompts", completed) - completed)
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": completed, "failed": failed,
        "errors": [e for e in saved.get("errors", []) if e][:5],
        "duration_s": saved.get("duration"),
        "request_throughput": saved.get("request_throughput"),
        "output_throughput": saved.get("output_throughput"),
        "total_token_throughput": saved.get("total_token_throughput"),
        "total_output_tokens": saved.get("total_output_tokens"),
        "ttft_ms": stats("ttft"), "tpot_ms": stats("tpot"), "itl_ms": stats("itl"),
        "e2e_latency_ms": stats("e2el"), "client": "vllm bench serve",
    }


def run_vllm_bench(command: list[str], result_dir: str, rate: float, log_path: str,
                   timeout_s: float) -> dict:
    """Runs vLLM's `bench serve` to its end -> its summary (its output goes to `log_path`)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    with open(log_path, "ab") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, timeout=timeout_s)
    path = os.path.join(result_dir, "result.json")
    if done.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"vllm bench serve exited {done.returncode}; its log: {log_path}")
    with open(path) as f:
        saved = json.load(f)
    os.unlink(path)
    return summary_from_vllm(saved, rate)


def new_result_dir(parent: str | None = None) -> str:
    return tempfile.mkdtemp(prefix="vllm-bench-", dir=parent)
