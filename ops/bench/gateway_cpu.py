"""The gateway's CPU time per output token: a local stack (the default model), N concurrent
requests of M tokens each (`ignore_eos`) through plain httpx, for completions and chat, streamed
and not; the gateway process's user + system CPU seconds (from /proc/<pid>/stat) over each
round, less its idle rate (measured first) over the round's wall time, per 1,000 output
tokens. CPU time rather than wall time, so a loaded machine blurs it less.

    .venv/bin/python -m ops.bench.gateway_cpu --requests 32 --max-tokens 64
"""
import argparse
import asyncio
import json
import os
import shutil
import socket
import tempfile
import time

import httpx

from ops.launcher import LocalStack
from shared.model_source import DEFAULT_MODEL_NAME

_MODES = {  # name: (path, streamed)
    "completions-stream": ("/v1/completions", True),
    "chat-stream": ("/v1/chat/completions", True),
    "completions": ("/v1/completions", False),
    "chat": ("/v1/chat/completions", False),
}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    # utime and stime are the 14th and 15th fields (the 12th and 13th after the name).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one(http: httpx.AsyncClient, path: str, stream: bool, max_tokens: int,
               index: int) -> int:
    body = {"model": DEFAULT_MODEL_NAME, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}
    text = f"Request {index}: write about the sea."
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
        tokens = 0
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{path}: {r.status_code} {(await r.aread()).decode()}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
        return tokens
    r = await http.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: {r.status_code} {r.text}")
    return r.json()["usage"]["completion_tokens"]


async def one_round(base_url: str, pid: int, mode: str, requests: int, max_tokens: int,
                    idle_rate: float = 0.0) -> dict:
    path, stream = _MODES[mode]
    limits = httpx.Limits(max_connections=requests + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        tokens = await asyncio.gather(*(_one(http, path, stream, max_tokens, i)
                                        for i in range(requests)))
        cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - t0
    total = sum(tokens)
    # Less what the gateway spends idle (its engine probes and heartbeats) over the same time:
    # on a loaded machine a round takes longer, not more work per token.
    busy = max(0.0, cpu - idle_rate * wall)
    return {"mode": mode, "requests": requests, "tokens": total, "wall_s": round(wall, 2),
            "gateway_cpu_s": round(cpu, 3), "idle_cpu_s": round(idle_rate * wall, 3),
            "cpu_ms_per_1k_tokens": round(1000 * 1000 * busy / max(total, 1), 1)}


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """The gateway's CPU seconds per second while it serves nothing."""
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests a round")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens a request")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of each mode")
    parser.add_argument("--modes", nargs="+", default=list(_MODES), choices=list(_MODES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--idle-s", type=float, default=10.0,
                        help="seconds of idle CPU measured first (subtracted from each round)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="pgcpu-", dir="/tmp")  # short: ipc paths have a length limit
    engine_args = {"dtype": args.dtype, "max_num_seqs": max(args.requests, 8),
                   "max_model_len": 1024}
    stack = LocalStack(engine_args=engine_args, run_dir=os.path.join(root, "stack"),
                       port=_free_port())
    results = []
    try:
        stack.start(timeout_s=300)
        pid = stack.processes["gateway"][0].pid
        # The gateway may still be taking the engine for away (it probes once a second).
        for _ in range(30):
            try:
                warm = asyncio.run(one_round(stack.gateway_url, pid, "completions-stream",
                                             min(4, args.requests), 8))
                break
            except RuntimeError:
                time.sleep(2)
        print(f"warm-up: {warm}")
        idle_rate = idle_cpu_rate(pid, args.idle_s)
        print(f"idle: {1000 * idle_rate:.2f} ms of CPU per second")
        for _ in range(args.rounds):
            for mode in args.modes:
                result = asyncio.run(one_round(stack.gateway_url, pid, mode, args.requests,
                                               args.max_tokens, idle_rate))
                print(json.dumps(result))
                results.append(result)
    finally:
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
