"""`pagoda bench throughput` on a tiny workload: pagoda and the transformers baseline both run
it, taking turns, each as many times as asked with fresh prompts, and the report holds what they
measured; the vLLM peer's protocol, with a stand-in for vLLM (not installed here)."""
import argparse
import json
import os
import sys
import textwrap
import time

import pytest

from ops.bench import throughput


def test_bench_throughput_runs_both_systems_repeatedly_and_reports_the_ratio(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                              "--repeats", "2", "--baseline", "hf", "--max-model-len", "64",
                              "--output-json", str(out)])
    assert throughput.run(args) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["repeats"] == 2
    for system in ("pagoda", "hf"):
        r = result[system]
        assert r["output_tokens"] == 3 * 4  # ignore_eos: every prompt runs to its length
        assert len(r["runs_s"]) == 2 and all(t > 0 for t in r["runs_s"])
        assert min(r["runs_s"]) <= r["elapsed_s"] <= max(r["runs_s"])
        assert r["output_tok_s"] == r["output_tokens"] / r["elapsed_s"]
        assert r["total_tok_s"] == (3 * 8 + 3 * 4) / r["elapsed_s"]
    assert result["ratio_output_tok_s"] == (result["pagoda"]["output_tok_s"]
                                            / result["hf"]["output_tok_s"])
    rounds = result["ratio_by_round"]
    assert len(rounds) == 2 and rounds == [
        (12 / p) / (12 / h) for p, h in zip(result["pagoda"]["runs_s"], result["hf"]["runs_s"])]
    assert result["matmul_gflops"] > 0 and 0 < result["pagoda"]["fraction_of_matmul_peak"] < 1
    printed = capsys.readouterr().out
    assert "ratio pagoda / transformers" in printed and "runs:" in printed
    assert "alternating runs: pagoda, hf" in printed and "by round:" in printed


def test_repeats_get_fresh_prompts():
    first, second = (throughput.make_workload(1000, {0, 1}, 4, 16, seed) for seed in (0, 1))
    assert first != second
    assert first == throughput.make_workload(1000, {0, 1}, 4, 16, 0)
    assert all(t not in (0, 1) for p in first + second for t in p)


class Recorder:
    """A system that only records when it ran (for the order of turns)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def run(self, prompts):
        self.log.append((self.name, len(prompts)))
        return 0.5 + 0.1 * len(self.log), 7

    def report(self):
        return {"reported": self.name}


def test_systems_take_turns_one_run_each_per_round():
    log = []
    workloads = [[[1]] * n for n in (1, 2, 3)]
    results = throughput.run_alternating([Recorder("a", log), Recorder("b", log)], workloads)
    # One run each per round, each round led by the next system.
    assert log == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
    assert results["a"]["runs_s"] == pytest.approx([0.6, 0.9, 1.0])
    assert results["b"]["runs_s"] == pytest.approx([0.7, 0.8, 1.1])
    assert results["a"]["elapsed_s"] == pytest.approx(0.9)  # the median run
    assert results["b"]["reported"] == "b" and results["b"]["output_tokens"] == 7


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
    monkeypatch.setattr(throughput, "hf_folder_for", lambda model_config: "/models/stand-in")
    from shared.config import EngineArgs
    config = EngineArgs(max_model_len=64).create_engine_config()
    workloads = [[[5, 6, 7], [8, 9]], [[10, 11, 12, 13]]]
    peer = throughput.VllmPeer(sys.executable, config, 4, workloads)
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
    peer = throughput.VllmPeer.__new__(throughput.VllmPeer)
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    peer.replies = os.fdopen(read_fd)
    peer.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    deadline = time.time() + 10
    while len(throughput.process_tree(peer.proc.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    tree = throughput.process_tree(peer.proc.pid)
    assert len(tree) == 2
    throughput.signal_tree(peer.proc.pid, signal.SIGSTOP)
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
    monkeypatch.setattr(throughput, "hf_folder_for", lambda model_config: "/models/stand-in")
    from shared.config import EngineArgs
    config = EngineArgs(max_model_len=64).create_engine_config()
    with pytest.raises(SystemExit, match="vLLM baseline failed"):
        throughput.VllmPeer(sys.executable, config, 4, [[[1, 2]]])


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
