"""Cancellation benchmark: a burst of abandoned requests, then one short request.

Each round: the short request's latency on an idle stack (median of a few), then `--requests`
chat requests for `--max-tokens` tokens, each abandoned by its client (the official `openai`
client, `timeout=--client-timeout`, no retries), then the short request again. It reports how
much slower the short request was after the burst, how long until the engine's health showed
nothing running or waiting and every KV block free, and how much work the engine did for the
abandoned requests (prompt and generated tokens, steps). `--burn N` keeps N processes spinning
on the CPU meanwhile (a loaded machine).

    python -m ops.bench.cancellation --rounds 3 --burn 2        # starts its own stack
    python -m ops.bench.cancellation --base-url http://127.0.0.1:8000 --run-dir /tmp/x/stack
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time

SHORT_PROMPT = [{"role": "user", "content": "Say hello."}]
LONG_PROMPT = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="a running gateway (without /v1); default: start a stack here")
    parser.add_argument("--run-dir", default=None,
                        help="the running stack's run directory (for the engine's health)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=200, help="abandoned requests a round")
    parser.add_argument("--max-tokens", type=int, default=8000)
    parser.add_argument("--client-timeout", type=float, default=0.5)
    parser.add_argument("--short-max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--burn", type=int, default=0, help="CPU burner processes")
    parser.add_argument("--idle-timeout", type=float, default=120.0,
                        help="seconds to wait for the engine to drain after a round")
    parser.add_argument("--output-json", default=None)


def _burn() -> None:
    while True:
        pass


async def _short(client, model: str, max_tokens: int) -> float:
    start = time.perf_counter()
    await client.chat.completions.create(model=model, messages=SHORT_PROMPT,
                                         max_tokens=max_tokens, temperature=0)
    return time.perf_counter() - start


async def _abandoned(client, model: str, max_tokens: int) -> str:
    import openai
    try:
        await client.chat.completions.create(model=model, messages=LONG_PROMPT,
                                             max_tokens=max_tokens, temperature=0)
        return "completed"
    except openai.APITimeoutError:
        return "timeout"
    except openai.APIError as e:
        return type(e).__name__


async def _engine_health(stack_config):
    from shared.sockets import probe_health
    return await asyncio.to_thread(probe_health, stack_config.engine_control, 2.0,
                                   curve=stack_config.curve)


def _idle(details: dict) -> bool:
    return (details.get("running") == 0 and details.get("waiting") == 0
            and details.get("free_blocks") == details.get("device_blocks"))


async def one_round(base_url: str, api_key: str, model: str, stack_config, args) -> dict:
    import openai
    patient = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0,
                                 timeout=600)
    impatient = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0,
                                   timeout=args.client_timeout)
    try:
        await _short(patient, model, args.short_max_tokens)  # warm-up
        unloaded_runs = [await _short(patient, model, args.short_max_tokens) for _ in range(3)]
        unloaded = statistics.median(unloaded_runs)
        before = (await _engine_health(stack_config)).details
        start = time.perf_counter()
        outcomes = await asyncio.gather(*[_abandoned(impatient, model, args.max_tokens)
                                          for _ in range(args.requests)])
        burst_s = time.perf_counter() - start
        after_burst = await _short(patient, model, args.short_max_tokens)
        # How long until the engine holds nothing of the burst.
        idle_s = None
        while time.perf_counter() - start < args.idle_timeout:
            details = (await _engine_health(stack_config)).details
            if _idle(details):
                idle_s = time.perf_counter() - start
                break
            await asyncio.sleep(0.1)
        # Work done for the abandoned requests arrives for a while after: settle, then count.
        await asyncio.sleep(2.0)
        after = (await _engine_health(stack_config)).details
    finally:
        await patient.close()
        await impatient.close()
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    return {"unloaded_s": round(unloaded, 3), "unloaded_runs": [round(x, 3) for x in unloaded_runs], "after_burst_s": round(after_burst, 3),
            "slowdown": round(after_burst / unloaded, 2), "burst_s": round(burst_s, 2),
            "engine_idle_s": None if idle_s is None else round(idle_s, 2),
            "outcomes": counts,
            "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
            "generation_tokens": after["generation_tokens"] - before["generation_tokens"],
            "steps": after["steps"] - before["steps"],
            "free_blocks_after": f"{after['free_blocks']}/{after['device_blocks']}"}


async def run_rounds(base_url: str, api_key: str, stack_config, args) -> list[dict]:
    import openai
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key) as c:
        model = (await c.models.list()).data[0].id
    results = []
    for i in range(args.rounds):
        r = await one_round(base_url, api_key, model, stack_config, args)
        print(f"round {i + 1}: {json.dumps(r)}", flush=True)
        results.append(r)
    return results


def main(args: argparse.Namespace) -> int:
    from ops.launcher import local_stack_config
    from shared.stack_config import StackConfig
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burn)]
    stack = None
    try:
        if args.base_url:
            base_url, api_key = args.base_url, args.api_key or os.environ.get("PAGODA_API_KEY")
            stack_config = local_stack_config(args.run_dir) if args.run_dir else StackConfig()
        else:
            from ops.launcher import LocalStack
            root = tempfile.mkdtemp(prefix="pcan-", dir="/tmp")
            api_key = "bench"
            stack = LocalStack(run_dir=os.path.join(root, "stack"), port=_free_port(),
                               api_key=api_key).start(timeout_s=600)
            base_url, stack_config = stack.gateway_url, stack.stack_config
        for p in burners:
            p.start()
        results = asyncio.run(run_rounds(base_url, api_key or "none", stack_config, args))
    finally:
        for p in burners:
            p.kill()
        if stack is not None:
            stack.stop()
    summary = {"burn": args.burn, "requests": args.requests,
               "median_slowdown": statistics.median(r["slowdown"] for r in results),
               "median_after_burst_s": statistics.median(r["after_burst_s"] for r in results),
               "rounds": results}
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
