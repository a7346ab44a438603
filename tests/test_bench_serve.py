"""`pagoda bench serve`: the statistics and plot, the managed comparison's bookkeeping (rounds,
seeds, medians, ratios), the CPU time grouped by process role, and one managed run of pagoda
serve alone on a tiny workload (real processes, the lean httpx client). vLLM is not started
here."""
import asyncio
import json
import math
import os
import subprocess
import sys

import pytest

from ops.bench.processes import (cpu_by_pid, cpu_delta_by_role, pagoda_role, process_tree,
                                 vllm_role)
from ops.bench.serve import save_plot
from ops.bench.serve_client import (HttpxClient, OpenaiClient, RequestResult, _stats_ms,
                                    summarize, summary_from_vllm)
from ops.bench.serve_compare import Workload, parse_workload, plan_passes, round_order
from ops.bench.serve_report import build_report, figures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_percentiles_interpolate_between_closest_ranks():
    stats = _stats_ms([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)


def test_summary_counts_failures_and_rates_over_the_run():
    done = RequestResult(ok=True, ttft=0.5, latency=2.5, output_tokens=5, itl=[0.5] * 4)
    failed = RequestResult(ok=False, error="APIError: boom")
    s = summarize(2.0, [done, done, failed], duration=10.0, input_len=64)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["APIError: boom"])
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["output_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx((10 + 128) / 10)
    assert s["tpot_ms"]["mean"] == pytest.approx(500.0)  # (2.5 - 0.5) / (5 - 1)
    assert s["ttft_ms"]["p99"] == pytest.approx(500.0)


def test_infinite_rate_is_reported_as_inf():
    assert summarize(math.inf, [], duration=1.0, input_len=1)["request_rate"] == "inf"


def _sse_body(texts: list[str], usage: bool, done: bool) -> bytes:
    """A streamed completion's body as a server writes it, the end marker(s) optional."""
    head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m"}
    chunks = [{**head, "choices": [{"index": 0, "text": t, "logprobs": None,
                                    "finish_reason": None}]} for t in texts]
    if usage:
        chunks.append({**head, "choices": [], "usage": {
            "prompt_tokens": 4, "completion_tokens": len(texts),
            "total_tokens": 4 + len(texts)}})
    events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] * done)
    return "".join(events).encode()


def _send_through(client_cls, body: bytes) -> RequestResult:
    """One request of the benchmark's client `client_cls`, answered with `body` (a server that
    wrote it and closed the connection)."""
    import httpx
    import openai

    async def go() -> RequestResult:
        def answer(request):
            return httpx.Response(200, content=body,
                                  headers={"content-type": "text/event-stream"})
        client = client_cls("http://bench.test", "key", 1, 10.0)
        transport = httpx.MockTransport(answer)
        if client_cls is HttpxClient:
            await client.http.aclose()
            client.http = httpx.AsyncClient(base_url="http://bench.test", transport=transport)
        else:
            await client.client.close()
            client.client = openai.AsyncOpenAI(
                base_url="http://bench.test/v1", api_key="key", max_retries=0,
                http_client=httpx.AsyncClient(transport=transport))
        try:
            return await client.send("m", [1, 2, 3, 4], 3)
        finally:
            await client.close()
    return asyncio.run(go())


@pytest.mark.parametrize("client_cls", [HttpxClient, OpenaiClient])
def test_a_stream_cut_off_before_its_end_counts_as_failed(client_cls):
    texts = ["a", "b", "c"]
    whole = _send_through(client_cls, _sse_body(texts, usage=True, done=True))
    assert whole.ok and whole.error == ""
    assert (whole.output_tokens, len(whole.itl)) == (3, 2)
    # The server died after some tokens: the body ends without the usage chunk and [DONE].
    cut = _send_through(client_cls, _sse_body(texts[:2], usage=False, done=False))
    assert not cut.ok and "cut off" in cut.error
    s = summarize(1.0, [whole, cut], duration=1.0, input_len=4)
    assert (s["completed"], s["failed"]) == (1, 1)
    assert any("cut off" in e for e in s["errors"])
    if client_cls is HttpxClient:  # it reads [DONE] itself: the usage chunk alone is no end
        cut = _send_through(client_cls, _sse_body(texts, usage=True, done=False))
        assert not cut.ok and "cut off" in cut.error


def test_plot_of_several_rates_is_a_png(tmp_path):
    result = RequestResult(ok=True, ttft=0.2, latency=1.0, output_tokens=3, itl=[0.4, 0.4])
    summaries = [summarize(r, [result], 1.0, 8) for r in (1.0, 4.0, math.inf)]
    path = tmp_path / "latency.png"
    save_plot(str(path), summaries, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vllm_saved_result_becomes_a_summary():
    saved = {"duration": 4.0, "completed": 7, "failed": 1, "request_throughput": 1.75,
             "output_throughput": 28.0, "total_token_throughput": 84.0,
             "total_output_tokens": 112, "mean_ttft_ms": 300.0, "median_ttft_ms": 250.0,
             "p50_ttft_ms": 250.0, "p90_ttft_ms": 400.0, "p99_ttft_ms": 480.0,
             "mean_tpot_ms": 20.0, "p50_tpot_ms": 19.0, "mean_itl_ms": 21.0,
             "median_itl_ms": 18.0, "mean_e2el_ms": 700.0, "p99_e2el_ms": 900.0}
    s = summary_from_vllm(saved, math.inf)
    assert (s["completed"], s["failed"], s["request_rate"]) == (7, 1, "inf")
    assert s["output_throughput"] == 28.0
    assert s["ttft_ms"] == {"mean": 300.0, "p50": 250.0, "p90": 400.0, "p99": 480.0}
    assert s["tpot_ms"]["p50"] == 19.0
    assert s["itl_ms"]["p50"] == 18.0  # the median stands in for a missing p50
    assert s["e2e_latency_ms"]["p99"] == 900.0


def test_passes_get_distinct_seeds_that_repeat_for_every_system():
    main = Workload("main", 4, 8, 2)
    extras = [parse_workload("64x1024x64"), parse_workload("256X32x32")]
    plan = plan_passes(main, 2, extras, seed=5)
    assert [(p.workload.name, p.index, p.kind) for p in plan] == [
        ("main", 0, "first"), ("main", 1, "warm"), ("main", 2, "warm"),
        ("64x1024x64", 0, "first"), ("256x32x32", 0, "first")]
    assert len({p.seed for p in plan}) == len(plan)
    assert [p.seed for p in plan] == [p.seed for p in plan_passes(main, 2, extras, seed=5)]
    assert (extras[0].num_prompts, extras[0].input_len, extras[0].output_len) == (64, 1024, 64)
    with pytest.raises(SystemExit, match="NxINxOUT"):
        parse_workload("64x1024")


def test_the_leading_system_alternates_between_rounds():
    assert [round_order(["pagoda", "vllm"], r) for r in range(3)] == [
        ["pagoda", "vllm"], ["vllm", "pagoda"], ["pagoda", "vllm"]]
    assert round_order(["pagoda"], 1) == ["pagoda"]


def _pass(system, rnd, index, tok_s, ttft, tpot, cpu, workload="main", failed=0):
    summary = {"output_throughput": tok_s, "ttft_ms": {"p50": ttft, "mean": ttft + 10},
               "tpot_ms": {"p50": tpot}, "failed": failed}
    return {"system": system, "round": rnd, "workload": workload, "pass": index,
            "kind": "first" if index == 0 else "warm", "summary": summary,
            "figures": figures(summary),
            "cpu_s": cpu, "client_cpu_s": 0.5 + index}


def test_report_medians_first_over_warm_and_ratios_by_round():
    passes = []
    for rnd, scale in ((0, 1.0), (1, 2.0)):  # round 1's machine runs twice as fast
        passes += [_pass("pagoda", rnd, 0, 50 * scale, 400, 40, {"worker": 3.0}),
                   _pass("pagoda", rnd, 1, 90 * scale, 200, 20, {"worker": 2.0, "gateway": 1}),
                   _pass("pagoda", rnd, 2, 110 * scale, 100, 10, {"worker": 4.0}),
                   _pass("vllm", rnd, 0, 40 * scale, 300, 30, {"engine core": 5.0}),
                   _pass("vllm", rnd, 1, 100 * scale, 150, 15, {"engine core": 6.0}),
                   _pass("vllm", rnd, 2, 100 * scale, 150, 15, {"engine core": 7.0})]
    passes.append(_pass("pagoda", 0, 0, 30, 900, 90, {"worker": 1.0}, workload="8x64x8",
                        failed=3))
    report = build_report(passes, ["pagoda", "vllm"])
    p, v, c = report["main"]["pagoda"], report["main"]["vllm"], report["main"]["pagoda_over_vllm"]
    assert p["first"] == {"output_tok_s": 75.0, "ttft_p50_ms": 400, "ttft_mean_ms": 410,
                          "tpot_p50_ms": 40}
    # warm: 90, 110 (round 0) and 180, 220 (round 1)
    assert p["warm"] == {"output_tok_s": 145.0, "ttft_p50_ms": 150.0, "ttft_mean_ms": 160.0,
                         "tpot_p50_ms": 15.0}
    assert p["first_over_warm"]["output_tok_s"] == pytest.approx(75 / 145)
    assert p["first_over_warm"]["ttft_p50_ms"] == pytest.approx(400 / 150)
    assert v["warm"]["output_tok_s"] == 150.0
    assert c["output_tok_s"] == pytest.approx(145 / 150)
    assert c["tpot_p50_ms"] == pytest.approx(1.0)
    assert c["ttft_mean_ms"] == pytest.approx(160 / 160)
    assert c["output_tok_s_by_round"] == pytest.approx([1.0, 1.0])  # each round's own medians
    # CPU: median per pass by role, a role absent from a pass counted as 0 there.
    assert p["cpu_s_per_pass"]["warm"] == {"gateway": 0.5, "worker": 3.0, "client": 2.0}
    assert v["cpu_s_per_pass"]["first"]["engine core"] == 5.0
    # A workload only pagoda ran: its report, no ratio; no warm passes: first only.
    assert report["8x64x8"]["pagoda"]["warm"] is None
    # Failed requests are counted where they happened.
    assert report["8x64x8"]["pagoda"]["failed"] == 3 and p["failed"] == 0
    assert "pagoda_over_vllm" not in report["8x64x8"]


def test_round_ratios_follow_each_round():
    passes = [_pass("pagoda", 0, 0, 100, 1, 1, {}), _pass("vllm", 0, 0, 50, 1, 1, {}),
              _pass("pagoda", 1, 0, 100, 1, 1, {}), _pass("vllm", 1, 0, 200, 1, 1, {})]
    c = build_report(passes, ["pagoda", "vllm"])["main"]["pagoda_over_vllm"]
    assert c["output_tok_s_by_round"] == pytest.approx([2.0, 0.5])
    assert c["output_tok_s_median_of_rounds"] == pytest.approx(1.25)
    assert c["output_tok_s"] == pytest.approx(100 / 125)  # the medians over both rounds


def test_process_roles_from_command_lines():
    py = "/venv/bin/python"
    assert pagoda_role([py, "-m", "pagoda", "engine", "--dtype", "bfloat16"]) == "engine"
    assert pagoda_role([py, "-m", "pagoda", "serve", "--port", "1"], True) == "serve"
    assert pagoda_role([py, "-c", "from multiprocessing.resource_tracker import main"]) == "other"
    assert vllm_role([py, "ops/bench/vllm_cli.py", "serve", "/m"], True) == "api server"
    assert vllm_role(["VLLM::EngineCore"], False) == "engine core"
    assert vllm_role([py, "-c", "from multiprocessing.resource_tracker import main"],
                     False) == "other"


def test_cpu_deltas_sum_by_role_and_count_new_processes_whole():
    before = {1: ("engine", 10.0), 2: ("worker", 5.0), 3: ("worker", 1.0)}
    after = {1: ("engine", 10.5), 2: ("worker", 7.0), 4: ("worker", 0.25), 5: ("gateway", 0.0)}
    assert cpu_delta_by_role(before, after) == {"engine": 0.5, "gateway": 0.0, "worker": 2.25}


def test_cpu_of_a_real_process_tree_by_role():
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"
            "\\ntime.sleep(30)']); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        import time
        deadline = time.time() + 20
        while len(process_tree(parent.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        before = cpu_by_pid(parent.pid, lambda argv, is_root: "root" if is_root else "child")
        time.sleep(1.0)
        after = cpu_by_pid(parent.pid, lambda argv, is_root: "root" if is_root else "child")
    finally:
        for pid in process_tree(parent.pid)[::-1]:
            os.kill(pid, 9)
        parent.wait()
    assert sorted(r for r, _ in after.values()) == ["child", "root"]
    spent = cpu_delta_by_role({}, after)
    assert spent["child"] >= 0.25  # it spun for 0.3 s of CPU
    assert cpu_delta_by_role(before, after)["root"] < 0.2


def test_managed_run_of_pagoda_alone_reports_every_pass(tmp_path):
    out = tmp_path / "managed.json"
    command = [sys.executable, "-m", "pagoda", "bench", "serve", "--baseline", "pagoda",
               "--rounds", "1", "--warm-passes", "1", "--num-prompts", "2", "--input-len", "8",
               "--output-len", "3", "--extra-workload", "2x16x2", "--kv-cache-space-gib",
               "0.1", "--max-model-len", "128", "--max-concurrency", "2",
               "--run-dir", str(tmp_path / "run"), "--output-json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["systems"] == ["pagoda"]
    assert [(p["workload"], p["pass"], p["kind"]) for p in result["passes"]] == [
        ("main", 0, "first"), ("main", 1, "warm"), ("2x16x2", 0, "first")]
    for p in result["passes"]:
        assert p["summary"]["completed"] == 2 and p["summary"]["failed"] == 0
        assert p["summary"]["total_output_tokens"] == 2 * (3 if p["workload"] == "main" else 2)
        assert {"gateway", "tokenizer", "engine", "worker", "detokenizer"} <= set(p["cpu_s"])
        assert p["cpu_s"]["worker"] > 0 and p["client_cpu_s"] > 0
        assert p["worker"]["steps"] >= 2 and p["worker"]["busy_s"] > 0
    main = result["report"]["main"]["pagoda"]
    assert main["first"]["output_tok_s"] > 0 and main["warm"]["tpot_p50_ms"] > 0
    assert main["first_over_warm"]["output_tok_s"] > 0
    assert "worker" in main["cpu_s_per_pass"]["warm"]
    assert main["worker_per_pass"]["busy_ms_per_step"] > 0
    assert result["report"]["2x16x2"]["pagoda"]["warm"] is None
    assert not os.path.exists(f"/proc/{result['servers'][0]['pid']}")  # stopped
