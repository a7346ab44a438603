"""LocalStack and `pagoda serve`: real processes on real ipc sockets, driven by docker-compose.yml:
launches that fail, and `pagoda serve` itself. A running LocalStack's processes, sockets,
arguments, logs, liveness loop and stop are tested on tests/test_stack.py's stack (one start)."""
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
from shared.stack_config import StackConfig

ROOT = os.path.dirname(default_compose_file())


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


def sockets_under(path: str) -> list[str]:
    import stat
    found = []
    for folder, _, files in os.walk(path):
        found += [f for f in files if stat.S_ISSOCK(os.lstat(os.path.join(folder, f)).st_mode)]
    return found


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


def test_the_compose_files_settings_reach_the_services_and_the_launcher_keeps_its_sockets(
        tmp_path, monkeypatch):
    # Set for the compose file's interpolation (as `.env` sets them), not in this environment:
    # the launcher's own StackConfig holds their defaults, and must not put those over them.
    for name in ("PAGODA_TOOL_CALL_PARSER", "PAGODA_ENABLE_PROMPT_TOKENS_DETAILS",
                 "PAGODA_RUN_DIR", "PAGODA_ENGINE_INPUT"):
        monkeypatch.delenv(name, raising=False)
    stack = LocalStack(run_dir=str(tmp_path), compose_vars={
        "PAGODA_TOOL_CALL_PARSER": "hermes", "PAGODA_ENABLE_PROMPT_TOKENS_DETAILS": "true"})
    stack._plan()
    gateway = next(m for m in stack.members if m.service == "gateway")
    assert gateway.env["PAGODA_TOOL_CALL_PARSER"] == "hermes"
    assert gateway.env["PAGODA_ENABLE_PROMPT_TOKENS_DETAILS"] == "true"
    # The sockets are the launcher's, not the compose file's tcp names.
    assert gateway.env["PAGODA_RUN_DIR"] == str(tmp_path)
    assert gateway.env["PAGODA_ENGINE_INPUT"] == stack.stack_config.engine_input
    assert gateway.env["PAGODA_ENGINE_INPUT"].startswith("ipc://")


def test_pagoda_serve_takes_the_serving_settings_as_flags(tmp_path, monkeypatch):
    # `pagoda serve --tool-call-parser hermes --enable-prompt-tokens-details`, as vLLM's serve
    # takes them: they reach the services as PAGODA_* variables, as serve hands them over.
    import argparse

    from ops.serve_cli import add_arguments, serving_vars
    from shared.stack_config import SERVING_FIELDS
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tool-call-parser", "hermes", "--enable-prompt-tokens-details",
                              "--trust-request-chat-template", "false"])
    assert serving_vars(args) == {"PAGODA_TOOL_CALL_PARSER": "hermes",
                                  "PAGODA_ENABLE_PROMPT_TOKENS_DETAILS": "true",
                                  "PAGODA_TRUST_REQUEST_CHAT_TEMPLATE": "false"}
    for name in SERVING_FIELDS:
        monkeypatch.delenv("PAGODA_" + name.upper(), raising=False)
    stack = LocalStack(run_dir=str(tmp_path), env=serving_vars(args))
    stack._plan()
    for member in stack.members:
        assert member.env["PAGODA_TOOL_CALL_PARSER"] == "hermes", member.name
        assert member.env["PAGODA_ENABLE_PROMPT_TOKENS_DETAILS"] == "true", member.name
        assert member.env["PAGODA_TRUST_REQUEST_CHAT_TEMPLATE"] == "false", member.name
