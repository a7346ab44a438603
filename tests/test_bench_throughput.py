"""`pagoda bench throughput` on tiny workloads: pagoda and the transformers baseline both run
them, taking turns, each as many times as asked with fresh prompts, and the report holds what
they measured, per workload; the workloads' prompts, the bookkeeping of several workloads with
fake systems, the matmul yardstick; the vLLM peer's protocol, with a stand-in for vLLM."""
import argparse
import json
import os
import sys
import textwrap
import time

import pytest
import torch

from ops.bench import peers, throughput, workloads, yardstick


def test_bench_throughput_runs_both_systems_repeatedly_and_reports_the_ratio(
        tmp_path, capsys, monkeypatch, reference):
    from transformers import AutoModelForCausalLM

    from shared.config import load_hf_config
    from shared.model_source import resolve_model
    # The baseline's transformers model: the session's fp32 reference, which is the same file
    # loaded the same way, rather than a second load (~15 s); what the baseline asked for is
    # checked below.
    loads = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda folder, **kwargs: (
        loads.append((folder, kwargs)) or reference.model))
    sent = []  # every prompt pagoda was given
    real_run = throughput.PagodaRunner.run
    monkeypatch.setattr(throughput.PagodaRunner, "run",
                        lambda self, prompts: sent.append(prompts) or real_run(self, prompts))
    # The real yardstick, on a smaller matmul for a shorter time than a benchmark's.
    monkeypatch.setattr(throughput, "Yardstick", lambda dtype, device: yardstick.Yardstick(
        dtype, device, lambda d, dev: yardstick.matmul_gflops(d, dev, n=512, seconds=0.2)))
    out = tmp_path / "throughput.json"
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                              "--repeats", "2", "--baseline", "hf", "--max-model-len", "64",
                              # not the 2 GiB default: its zero-fill alone takes ~14 s here
                              "--kv-cache-space-gib", "0.1",
                              "--workloads", "fixed", "mixed", "--input-len-range", "2", "12",
                              "--output-json", str(out)])
    assert throughput.run(args) == 0
    source = resolve_model(None)
    assert [(folder, kw["gguf_file"], kw["dtype"], kw["config"].to_dict()) for folder, kw in loads
            ] == [(source.folder, source.gguf_file, torch.float32,
                   load_hf_config(source).to_dict())]  # the engine's config
    result = json.loads(out.read_text())
    assert result["repeats"] == 2 and list(result["workloads"]) == ["fixed", "mixed"]
    # Per round: fixed, then mixed, on each system; pagoda leads round 1, hf round 2.
    assert [len(p) for p in sent] == [3] * 4
    input_tokens = {"fixed": sum(len(p) for p in sent[0]), "mixed": sum(len(p) for p in sent[1])}
    assert input_tokens["fixed"] == 3 * 8 and all(2 <= len(p) <= 12 for p in sent[1])
    assert [len(p) for p in sent[1]] == [len(p) for p in sent[3]] and sent[1] != sent[3]
    for name, w in result["workloads"].items():
        assert w["workload"]["input_tokens"] == input_tokens[name]
        for system in ("pagoda", "hf"):
            r = w[system]
            assert r["output_tokens"] == 3 * 4  # ignore_eos: every prompt runs to its length
            assert len(r["runs_s"]) == 2 and all(t > 0 for t in r["runs_s"])
            assert min(r["runs_s"]) <= r["elapsed_s"] <= max(r["runs_s"])
            assert r["output_tok_s"] == r["output_tokens"] / r["elapsed_s"]
            assert r["total_tok_s"] == (input_tokens[name] + 3 * 4) / r["elapsed_s"]
        assert w["ratio_output_tok_s"] == w["pagoda"]["output_tok_s"] / w["hf"]["output_tok_s"]
        assert len(w["ratio_by_round"]) == 2 and w["ratio_by_round"] == [
            (12 / p) / (12 / h) for p, h in zip(w["pagoda"]["runs_s"], w["hf"]["runs_s"])]
        assert 0 < w["pagoda"]["fraction_of_matmul_peak"] < 1
    rates = [m["gflops"] for m in result["matmul_gflops_all"]]
    assert len(rates) == 3 and result["matmul_gflops"] == max(rates) > 0  # start, 2 rounds
    printed = capsys.readouterr().out
    assert "ratio pagoda / transformers" in printed and "runs:" in printed
    assert "alternating runs: pagoda, hf" in printed and "by round:" in printed
    assert "workload fixed:" in printed and "workload mixed:" in printed


def test_repeats_get_fresh_prompts():
    first, second = (throughput.make_workload(1000, {0, 1}, 4, 16, seed) for seed in (0, 1))
    assert first != second
    assert first == throughput.make_workload(1000, {0, 1}, 4, 16, 0)
    assert all(t not in (0, 1) for p in first + second for t in p)


def test_the_mixed_workload_draws_lengths_in_range_the_same_for_a_seed():
    def build(seed, num_prompts=200):
        return workloads.build_workloads(["fixed", "mixed"], 1000, {0, 1}, num_prompts, 16,
                                         (5, 9), 3, seed)
    fixed, mixed = build(0)
    lengths = [len(p) for p in mixed.rounds[0]]
    assert set(lengths) == {5, 6, 7, 8, 9}  # both ends included, nothing outside
    assert all([len(p) for p in prompts] == lengths for prompts in mixed.rounds)
    assert len({str(prompts) for prompts in mixed.rounds}) == 3  # fresh tokens every round
    assert mixed.input_tokens == sum(lengths) and mixed.num_prompts == 200
    assert all(t not in (0, 1) for prompts in mixed.rounds for p in prompts for t in p)
    assert build(0)[1].rounds == mixed.rounds and build(1)[1].rounds[0] != mixed.rounds[0]
    # fixed is the workload the benchmark ran before, round r on seed + r
    assert fixed.rounds == [throughput.make_workload(1000, {0, 1}, 200, 16, r) for r in range(3)]
    assert fixed.input_tokens == 200 * 16
    # no prompt of one starts as a prompt of the other does (no prefix cache hit between them)
    starts = {tuple(p[:4]) for prompts in fixed.rounds for p in prompts}
    assert not starts & {tuple(p[:4]) for prompts in mixed.rounds for p in prompts}
    with pytest.raises(SystemExit, match="--input-len-range"):
        workloads.build_workloads(["mixed"], 1000, set(), 4, 16, (9, 5), 1, 0)


class Recorder:
    """A system that only records when it ran (for the order of turns)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def run(self, prompts):
        self.log.append((self.name, prompts[0][0]))
        return 0.5 + 0.1 * len(self.log), 7

    def report(self):
        return {"reported": self.name}


def test_systems_take_turns_one_run_each_per_round():
    log = []
    rounds = workloads.Workload("w", [[[n]] for n in (1, 2, 3)])
    results = throughput.run_alternating([Recorder("a", log), Recorder("b", log)], [rounds])
    # One run each per round, each round led by the next system.
    assert log == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
    results = results["w"]
    assert results["a"]["runs_s"] == pytest.approx([0.6, 0.9, 1.0])
    assert results["b"]["runs_s"] == pytest.approx([0.7, 0.8, 1.1])
    assert results["a"]["elapsed_s"] == pytest.approx(0.9)  # the median run
    assert results["b"]["reported"] == "b" and results["b"]["output_tokens"] == 7


class FakeSystem:
    """A system with set run times: SECONDS[(name, workload's first token, round)]; it logs
    its runs and the prompt tokens it was given."""

    def __init__(self, name, log):
        self.name, self.log, self.rounds = name, log, {}

    def run(self, prompts):
        key = prompts[0][0]
        i = self.rounds[key] = self.rounds.get(key, -1) + 1
        self.log.append((self.name, key, sum(len(p) for p in prompts)))
        return SECONDS[(self.name, key, i)], 4 * len(prompts)

    def report(self):
        return {"num_params": 10 ** 6}

    def close(self):
        pass


# pagoda and hf on two workloads (first tokens 1 and 2) over three rounds, in seconds.
SECONDS = {("pagoda", 1, 0): 2.0, ("pagoda", 1, 1): 3.0, ("pagoda", 1, 2): 1.0,
           ("hf", 1, 0): 4.0, ("hf", 1, 1): 4.0, ("hf", 1, 2): 8.0,
           ("pagoda", 2, 0): 5.0, ("pagoda", 2, 1): 6.0, ("pagoda", 2, 2): 7.0,
           ("hf", 2, 0): 10.0, ("hf", 2, 1): 3.0, ("hf", 2, 2): 7.0}


def test_several_workloads_get_their_own_medians_and_round_ratios(tmp_path, monkeypatch, capsys):
    """run() with fake systems (no model): per workload, each system's runs, median and rates
    from that workload's own prompt lengths, and pagoda / hf by round; the matmul rate measured
    at the start and after every round, once the round's runs are over, the best one kept."""
    log, rates = [], iter([300.0, 900.0, 600.0, 700.0])
    prompts = {"fixed": [[1] * 5, [1] * 5], "mixed": [[2] * 3, [2] * 9]}

    def fake_build(names, *args):
        return [workloads.Workload(n, [[list(p) for p in prompts[n]]] * 3) for n in names]

    def fake_gflops(dtype, device):
        log.append("matmul")
        return next(rates)
    monkeypatch.setattr(throughput, "build_workloads", fake_build)
    monkeypatch.setattr(throughput, "PagodaRunner", lambda *a: FakeSystem("pagoda", log))
    monkeypatch.setattr(throughput, "HfRunner", lambda *a: FakeSystem("hf", log))
    monkeypatch.setattr(throughput, "Yardstick", lambda dtype, device: yardstick.Yardstick(
        dtype, device, measure_gflops=fake_gflops))
    out = tmp_path / "throughput.json"
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    assert throughput.run(parser.parse_args([
        "--workloads", "fixed", "mixed", "--repeats", "3", "--baseline", "hf",
        "--output-len", "4", "--max-model-len", "64", "--output-json", str(out)])) == 0
    result = json.loads(out.read_text())

    runs = [entry for entry in log if entry != "matmul"]
    assert runs == [("pagoda", 1, 10), ("hf", 1, 10), ("pagoda", 2, 12), ("hf", 2, 12),
                    ("hf", 1, 10), ("pagoda", 1, 10), ("hf", 2, 12), ("pagoda", 2, 12),
                    ("pagoda", 1, 10), ("hf", 1, 10), ("pagoda", 2, 12), ("hf", 2, 12)]
    assert [i for i, entry in enumerate(log) if entry == "matmul"] == [0, 5, 10, 15]
    assert result["matmul_gflops"] == 900.0
    assert [m["gflops"] for m in result["matmul_gflops_all"]] == [300.0, 900.0, 600.0, 700.0]

    for name, first, input_tokens in (("fixed", 1, 10), ("mixed", 2, 12)):
        w = result["workloads"][name]
        assert w["workload"]["input_tokens"] == input_tokens
        for system in ("pagoda", "hf"):
            r = w[system]
            seconds = [SECONDS[(system, first, i)] for i in range(3)]
            assert r["runs_s"] == seconds and r["elapsed_s"] == sorted(seconds)[1]
            assert r["output_tok_s"] == 8 / r["elapsed_s"]
            assert r["total_tok_s"] == (input_tokens + 8) / r["elapsed_s"]
        assert w["ratio_by_round"] == pytest.approx(
            [SECONDS[("hf", first, i)] / SECONDS[("pagoda", first, i)] for i in range(3)])
        assert w["ratio_output_tok_s"] == pytest.approx(
            w["hf"]["elapsed_s"] / w["pagoda"]["elapsed_s"])
        assert w["pagoda"]["fraction_of_matmul_peak"] == pytest.approx(
            2e6 * w["pagoda"]["total_tok_s"] / 900e9)
    assert result["workloads"]["fixed"]["ratio_by_round"] == pytest.approx([2.0, 4 / 3, 8.0])
    printed = capsys.readouterr().out
    assert "matmul 900 GFLOP/s, the best of: 300 (before the systems start), 900 (after round " \
           "1), 600 (after round 2), 700 (after round 3)" in printed
    assert "by round: 2.00, 1.33, 8.00; median 2.00x" in printed  # fixed
    assert "by round: 2.00, 0.50, 1.00; median 1.00x" in printed  # mixed


def test_the_yardstick_keeps_every_rate_and_holds_to_the_best():
    rates = iter([326.0, 733.0, 512.0])
    stick = yardstick.Yardstick(torch.bfloat16, torch.device("cpu"),
                                measure_gflops=lambda dtype, device: next(rates))
    for when in ("start", "round 1", "round 2"):
        stick.measure(when)
    assert stick.best == 733.0
    assert stick.fraction(366.5e9) == pytest.approx(0.5)
    assert stick.summary()["matmul_gflops_all"] == [
        {"when": "start", "gflops": 326.0}, {"when": "round 1", "gflops": 733.0},
        {"when": "round 2", "gflops": 512.0}]
    # the real measurement: a positive rate
    assert yardstick.matmul_gflops(torch.float32, torch.device("cpu"), n=64, seconds=0.05) > 0


# A stand-in for vLLM's offline API, as much of it as ops/bench/vllm_peer.py uses: each prompt
# gets `max_tokens` tokens, and every call is logged with the settings it came with.
FAKE_VLLM = """
import json, os
__version__ = "0.0-stand-in"
LOG = os.environ["FAKE_VLLM_LOG"]

def _log(**entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\\n")

class SamplingParams:
    def __init__(self, max_tokens, ignore_eos=False, temperature=1.0):
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))

class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]

class LLM:
    def __init__(self, **kwargs):
        _log(init=kwargs, bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))

    def generate(self, prompts, params, use_tqdm=True):
        _log(generate=[p["prompt_token_ids"] for p in prompts], max_tokens=params.max_tokens)
        return [_Output(params.max_tokens) for _ in prompts]
"""


def test_the_vllm_peer_takes_prompts_per_run_and_answers_on_its_pipe(tmp_path, monkeypatch):
    """ops/bench/vllm_peer.py run by a real second interpreter, talking over its stdin and the
    reply pipe; only vLLM itself is a stand-in (FAKE_VLLM), which logs what it was asked."""
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (package / "inputs.py").write_text("TokensPrompt = dict\n")
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(peers, "hf_folder_for", lambda model_config: "/models/stand-in")
    from shared.engine_args import EngineArgs
    config = EngineArgs(max_model_len=64).create_engine_config()
    workloads = [[[5, 6, 7], [8, 9]], [[10, 11, 12, 13]]]
    peer = peers.VllmPeer(sys.executable, config, 4, workloads)
    try:
        assert peer.report()["version"] == "0.0-stand-in" and peer.report()["startup_s"] >= 0
        runs = []
        for prompts in workloads:
            runs.append(peer.run(prompts))
            # Between its runs the peer is stopped: nothing of it runs beside the next system.
            assert stopped(peer.proc.pid)
    finally:
        peer.close()
    assert peer.proc.returncode == 0  # stdin's end stopped it
    assert [n for _, n in runs] == [2 * 4, 1 * 4] and all(t >= 0 for t, _ in runs)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    init = calls[0]
    assert init["init"]["model"] == "/models/stand-in" and init["init"]["max_model_len"] == 4 + 4
    assert init["init"]["gpu_memory_utilization"] == 0.5  # on the CPU: beside this process
    # and its KV cache as large as pagoda's (no share of the machine asked for)
    assert init["init"]["kv_cache_memory_bytes"] == config.cache_config.kv_cache_space_gib * 2 ** 30
    cpus = sorted(os.sched_getaffinity(0))
    assert init["bind"] == f"{cpus[0]}-{cpus[-1]}"  # every core this process may use
    assert calls[1] == {"generate": [[5, 6, 7], [8, 9]], "max_tokens": 2}  # the warm-up
    assert [c["generate"] for c in calls[2:]] == workloads
    assert all(c["max_tokens"] == 4 for c in calls[2:])


def stopped(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether the process reaches the stopped state (SIGSTOP takes effect asynchronously)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        time.sleep(0.02)
    return False


def test_a_stopped_peer_is_killed_with_its_children_at_close(monkeypatch):
    """close() on a peer that never answers (here: a process with a child, both asleep, then
    stopped as between runs) ends the whole tree instead of leaving it stopped."""
    import signal
    import subprocess
    code = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', " \
           "'import time; time.sleep(300)'])\ntime.sleep(300)"
    peer = peers.VllmPeer.__new__(peers.VllmPeer)
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    peer.replies = os.fdopen(read_fd)
    peer.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    deadline = time.time() + 10
    while len(throughput.process_tree(peer.proc.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    tree = throughput.process_tree(peer.proc.pid)
    assert len(tree) == 2
    peers.signal_tree(peer.proc.pid, signal.SIGSTOP)
    monkeypatch.setattr(peer.proc, "wait", lambda timeout=None, _wait=peer.proc.wait: _wait(
        timeout=min(timeout or 5, 5)))  # not two minutes: the sleeper ignores stdin's end
    peer.close()
    assert peer.proc.returncode is not None
    child = tree[1]
    deadline = time.time() + 5
    while os.path.exists(f"/proc/{child}") and time.time() < deadline:
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # killed; its parent is gone and init has yet to reap it
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{child}")


def test_a_vllm_peer_that_dies_at_start_is_a_clear_error(tmp_path, monkeypatch):
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('no vLLM here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setattr(peers, "hf_folder_for", lambda model_config: "/models/stand-in")
    from shared.engine_args import EngineArgs
    config = EngineArgs(max_model_len=64).create_engine_config()
    with pytest.raises(SystemExit, match="vLLM baseline failed"):
        peers.VllmPeer(sys.executable, config, 4, [[[1, 2]]])


def test_wait_until_idle_waits_for_a_busy_process_tree_to_go_quiet():
    """A child that spins for ~1 s and then sleeps: the wait ends after the spin, not before."""
    import subprocess
    code = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.2)
        cpu_before = throughput.process_tree_cpu_s(proc.pid)
        waited = throughput.wait_until_idle(proc.pid)
        assert 0.3 <= waited < 10
        assert throughput.process_tree_cpu_s(proc.pid) - cpu_before >= 0.3  # it did spin
        assert throughput.wait_until_idle(proc.pid) < 1  # quiet now: one window
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_yardstick_times_the_panel_matmul_too_where_it_runs(dtype, monkeypatch):
    """On the CPU the yardstick is the faster of torch's matmul and the project's panel matmul
    (torch's fp32 matmul runs well below the panels on some CPUs); both are timed."""
    from pagoda_kernels import cpu as cpu_kernels
    name = "f32_linear" if dtype == torch.float32 else "bf16_linear"
    available = (cpu_kernels.f32_matmul_available() if dtype == torch.float32
                 else cpu_kernels.bf16_matmul_available())
    if not available:
        pytest.skip(f"no {dtype} panel matmul on this CPU")
    calls = []
    real = getattr(cpu_kernels, name)

    def counted(x, packed, bias, n):
        out = real(x, packed, bias, n)
        calls.append(out.shape)
        return out
    monkeypatch.setattr(cpu_kernels, name, counted)
    assert yardstick.matmul_gflops(dtype, torch.device("cpu"), n=64, seconds=0.05) > 0
    assert calls and calls[0] == (64, 64)


def test_onednn_baseline_runs_pagoda_again_with_its_fp32_weights_packed_for_onednn(
        tmp_path, capsys, monkeypatch):
    from services.worker.models import linear
    runners = []
    real_init = throughput.PagodaRunner.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        runners.append(self)
    monkeypatch.setattr(throughput.PagodaRunner, "__init__", init)
    monkeypatch.setattr(throughput, "Yardstick", lambda dtype, device: yardstick.Yardstick(
        dtype, device, lambda d, dev: yardstick.matmul_gflops(d, dev, n=256, seconds=0.1)))
    chosen = linear.fp32_layout()
    out = tmp_path / "throughput.json"
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                              "--baseline", "onednn", "--dtype", "float32",
                              "--max-model-len", "64", "--kv-cache-space-gib", "0.05",
                              "--output-json", str(out)])
    assert throughput.run(args) == 0
    assert [r.name for r in runners] == ["pagoda", "onednn"]
    assert linear.fp32_layout() == chosen  # the process's layout is put back

    def kinds(runner):
        model = runner.llm.llm_engine.executor.worker.model_runner.model
        return {m.packed.kind for m in model.modules()
                if isinstance(getattr(m, "packed", None), linear.PackedWeight)
                and m.packed.out_features != model.config.vocab_size}  # the LM head: its own
    assert kinds(runners[1]) == {"onednn"}
    assert kinds(runners[0]) == ({"f32"} if chosen == "panels" else
                                 {"onednn"} if chosen == "onednn" else set())
    w = json.loads(out.read_text())["workloads"]["fixed"]
    assert w["onednn"]["output_tokens"] == w["pagoda"]["output_tokens"] == 2 * 3
    assert w["ratio_vs_onednn_output_tok_s"] == (w["pagoda"]["output_tok_s"]
                                                 / w["onednn"]["output_tok_s"])
    assert "ratio pagoda / pagoda on oneDNN" in capsys.readouterr().out


def test_onednn_baseline_needs_fp32():
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "1", "--input-len", "4", "--output-len", "1",
                              "--baseline", "onednn", "--dtype", "bfloat16",
                              "--max-model-len", "64", "--kv-cache-space-gib", "0.05"])
    with pytest.raises(SystemExit, match="needs --dtype float32"):
        throughput.run(args)
