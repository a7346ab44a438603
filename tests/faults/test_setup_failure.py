"""A worker whose KV cache cannot be set up (here: a cache far larger than the machine's memory,
so its allocation fails as an out-of-memory would): the engine tries a bounded number of times,
then stops, stays up and says why in its health answer and its log; nothing crash-loops."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

from shared.sockets import probe_health
from shared.stack_config import StackConfig

IMPOSSIBLE_CACHE_GIB = "100000"


def spawn(command: str, run_dir: str, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "PAGODA_RUN_DIR": run_dir, "PAGODA_LIVENESS_TIMEOUT_S": "4",
           "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "pagoda", command, "--kv-cache-space-gib",
                                 IMPOSSIBLE_CACHE_GIB], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def test_a_cache_setup_that_keeps_failing_is_tried_three_times_then_reported_not_retried():
    run_dir = tempfile.mkdtemp(prefix="psetup-", dir="/tmp")
    stack = StackConfig(run_dir=run_dir)
    engine_log, worker_log = (os.path.join(run_dir, f"{s}.log") for s in ("engine", "worker"))
    engine = spawn("engine", run_dir, engine_log)
    worker = spawn("worker", run_dir, worker_log)
    try:
        deadline = time.monotonic() + 240
        health = None
        while time.monotonic() < deadline:
            assert engine.poll() is None, open(engine_log).read()[-3000:]
            health = probe_health(stack.engine_control, 2)
            if health is not None and health.status == "failed":
                break
            time.sleep(0.5)
        assert health is not None and health.status == "failed", health
        error = health.details["error"]
        assert "initialize_cache failed" in error and "failed 3 times" in error, error
        # It stays that way: the engine no longer calls the worker, and keeps answering.
        time.sleep(6)
        again = probe_health(stack.engine_control, 2)
        assert again is not None and again.status == "failed"
        assert engine.poll() is None and worker.poll() is None
        with open(engine_log) as f:
            text = f.read()
        assert text.count("worker setup failed") == 3, text[-3000:]
        assert "giving up on these worker processes" in text
        print(f"\nsetup failure reported after 3 attempts: {error[:160]}")
    finally:
        for p in (engine, worker):
            p.terminate()
        for p in (engine, worker):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
