"""LocalStack and `pagoda serve`: real processes on real ipc sockets, driven by docker-compose.yml."""
import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from ops.compose import default_compose_file
from ops.launcher import LaunchError, LocalStack
from services.gateway.client import AsyncEngineClient
from shared.sampling_params import SamplingParams
from shared.sockets import probe_health
from shared.stack_config import StackConfig

ROOT = os.path.dirname(default_compose_file())
# A small KV cache keeps each stack's memory low on a shared machine.
ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_num_seqs": 8}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def cmdline_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")[:-1]


def sockets_under(path: str) -> list[str]:
    import stat
    found = []
    for folder, _, files in os.walk(path):
        found += [f for f in files if stat.S_ISSOCK(os.lstat(os.path.join(folder, f)).st_mode)]
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("stack") / "run")
    launched = LocalStack(engine_args=ENGINE_ARGS, tokenizers=2, run_dir=run_dir, gateway=False)
    launched.start(timeout_s=300)
    yield launched
    launched.stop()


# -- a running stack ---------------------------------------------------------------------------
def test_stack_starts_one_process_per_instance(stack):
    counts = {name: len(procs) for name, procs in stack.processes.items()}
    assert counts == {"tokenizer": 2, "engine": 1, "worker": 1, "detokenizer": 1}


def test_every_process_answers_its_probe_with_ok(stack):
    for member in stack.members:
        health = probe_health(member.control_addr, timeout_s=2)
        assert health is not None and health.status == "ok", member.name


def test_engine_sees_every_tokenizer_detokenizer_and_worker(stack):
    details = probe_health(stack.stack_config.engine_control, timeout_s=2).details
    assert (details["tokenizers"], details["detokenizers"], details["workers"]) == (2, 1, 1)


def test_a_request_completes_through_the_stack(stack):
    async def generate() -> tuple[str, bool]:
        client = AsyncEngineClient(stack.stack_config)
        text, finished = "", False
        try:
            async for out in client.generate("The capital of France is",
                                             SamplingParams(max_tokens=4, temperature=0)):
                text += out.outputs[0].text
                finished = out.finished
        finally:
            client.close()
        return text, finished

    text, finished = asyncio.run(asyncio.wait_for(generate(), 120))
    assert finished and text.strip()


def test_processes_use_ipc_sockets_in_the_run_directory(stack):
    engine = stack.processes["engine"][0]
    env = environ_of(engine.pid)
    assert env["PAGODA_RUN_DIR"] == stack.run_dir
    for key in ("PAGODA_REQUEST_INPUT", "PAGODA_TOKENIZER_INPUT", "PAGODA_ENGINE_INPUT",
                "PAGODA_WORKER_ADDR", "PAGODA_DETOKENIZER_ADDR", "PAGODA_ENGINE_CONTROL"):
        assert env[key].startswith(f"ipc://{stack.run_dir}/"), key
    assert "PAGODA_CONTROL_ADDR" not in env  # each process has its own control socket


def test_engine_args_reach_each_service_that_accepts_them(stack):
    tokenizer = cmdline_of(stack.processes["tokenizer"][1].pid)
    assert tokenizer[1:4] == ["-m", "pagoda", "tokenizer"]
    assert tokenizer[tokenizer.index("--max-num-seqs") + 1] == "8"
    assert tokenizer[tokenizer.index("--instance") + 1] == "1"
    detokenizer = cmdline_of(stack.processes["detokenizer"][0].pid)
    # Every service takes the one engine command line (the detokenizer uses only the model's).
    assert detokenizer[detokenizer.index("--max-num-seqs") + 1] == "8"


def test_each_process_logs_to_its_own_file(stack):
    logs = sorted(os.listdir(stack.log_dir))
    assert logs == ["detokenizer-0.log", "engine-0.log", "tokenizer-0.log", "tokenizer-1.log",
                    "worker-0.log"]
    with open(os.path.join(stack.log_dir, "engine-0.log")) as f:
        assert "engine ready" in f.read()


def test_liveness_loop_restarts_a_process_that_exited(stack):
    old = stack.kill("detokenizer", 0, signal.SIGKILL)
    [detokenizer] = [m for m in stack.members if m.name == "detokenizer-0"]
    stop = threading.Event()

    def stop_when_back():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not stop.is_set():
            if stack.processes["detokenizer"][0] is not old and detokenizer.healthy:
                break
            time.sleep(0.5)
        stop.set()

    watcher = threading.Thread(target=stop_when_back)
    watcher.start()
    stack.supervise(stop, check_every_s=0.5)  # in this thread: it spawns the new process
    watcher.join()
    new = stack.processes["detokenizer"][0]
    assert new.pid != old.pid and new.poll() is None
    health = probe_health(stack.stack_config.control_for("detokenizer", 0), timeout_s=2)
    assert health is not None and health.status == "ok"


def test_a_second_stack_in_the_same_run_directory_is_refused(stack):
    second = LocalStack(run_dir=stack.run_dir, gateway=False)
    with pytest.raises(LaunchError, match="already runs"):
        second.start(timeout_s=30)
    assert second.processes == {}
    assert probe_health(stack.stack_config.engine_control, timeout_s=2).status == "ok"
    assert os.path.exists(stack.stack_config.request_input[len("ipc://"):])


def test_stop_leaves_no_process_and_no_socket(stack):
    pids = [p.pid for procs in stack.processes.values() for p in procs]
    grandchildren = [c for pid in pids for c in children_of(pid)]
    stack.stop()
    assert not [pid for pid in pids + grandchildren if alive(pid)]
    assert not os.path.exists(stack.run_dir)


# -- failed launches -----------------------------------------------------------------------------
def test_default_run_dir_is_where_a_default_client_looks(monkeypatch):
    for key in list(os.environ):
        if key.startswith("PAGODA_"):
            monkeypatch.delenv(key)
    launcher = LocalStack(gateway=False)
    assert launcher.run_dir == StackConfig().run_dir
    assert launcher.stack_config.request_input == StackConfig().request_input
    assert launcher.stack_config.engine_control == StackConfig().engine_control


def test_a_bad_model_path_stops_the_launch_with_the_services_error(tmp_path):
    launcher = LocalStack(engine_args={"model": str(tmp_path / "no-such-model")},
                          run_dir=str(tmp_path / "run"), gateway=False)
    with pytest.raises(LaunchError) as failure:
        launcher.start(timeout_s=120)
    assert failure.value.service.split("-")[0] in {"engine", "worker", "tokenizer", "detokenizer"}
    assert "no-such-model" in str(failure.value)
    assert "is not a local folder" in str(failure.value)  # the service's own error, from its log
    assert not [p.pid for procs in launcher.processes.values() for p in procs if alive(p.pid)]
    assert not os.path.exists(tmp_path / "run")


def test_one_failing_service_stops_the_whole_launch(tmp_path):
    compose = tmp_path / "docker-compose.yml"
    with open(default_compose_file()) as f:
        text = f.read()
    broken = text.replace("command: pagoda tokenizer ", "command: pagoda tokenizer --dtype float8 ")
    assert broken != text
    compose.write_text(broken)
    launcher = LocalStack(compose_file=str(compose), run_dir=str(tmp_path / "run"), gateway=False)
    with pytest.raises(LaunchError) as failure:
        launcher.start(timeout_s=120)
    assert failure.value.service == "tokenizer-0"
    assert "dtype: must be auto, float32" in str(failure.value)
    assert not [p.pid for procs in launcher.processes.values() for p in procs if alive(p.pid)]
    assert sockets_under(str(tmp_path)) == []


# -- the command line ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pagoda_serve_serves_http_and_stops_cleanly_on_sigterm(tmp_path):
    run_dir, port = str(tmp_path / "run"), free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "pagoda", "serve", "--run-dir", run_dir, "--port", str(port),
         "--kv-cache-space-gib", "0.25"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in serve.stdout], daemon=True).start()
    output = []
    try:
        deadline = time.monotonic() + 300
        while not any("Ctrl-C stops the stack" in line for line in output):
            assert serve.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "".join(output)
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        assert any(f"http://127.0.0.1:{port}" in line for line in output)
        children = children_of(serve.pid)
        assert len(children) == 5  # gateway, engine, worker, tokenizer, detokenizer
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            health = json.load(reply)
        assert (health["status"], health["tokenizers"], health["workers"]) == ("ok", 1, 1)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert not [pid for pid in children if alive(pid)]
    assert not os.path.exists(run_dir)
