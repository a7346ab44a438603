"""The serve section: `pagoda serve` on the 1B random model under `pagoda bench serve` (output
tok/s, TTFT, TPOT; skipped when the wheels it needs are missing), and the child processes it
starts and stops."""
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from .measure import free_device_memory
from .plan import ModelSpec, serve_model
from .random_models import hf_config, random_model, save_folder
from .report import Row, Run, log, num

SERVE_MODULES = ("zmq", "structlog", "fastapi", "uvicorn", "pydantic", "openai")


def section_serve(run: Run, device) -> list:
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"missing {', '.join(missing)} (carry the wheels: ops/gpu_wheels.sh)"
        log(run, f"serve: skipped: {reason}")
        return [Row("serve", "pagoda serve + bench serve", f"skipped: {reason}",
                    verdict="skipped")]
    p = run.plan
    spec = serve_model(p)
    folder = run.folders.get(spec.name) or build_folder(run, device, spec)
    port = free_port()
    run_dir = os.path.join(run.work_dir, "serve")
    max_len = p.serve_input_len + p.serve_output_len + 16
    command = [sys.executable, "-m", "pagoda", "serve", "--model", folder,
               "--device", p.device, "--dtype", "bfloat16", "--port", str(port),
               "--run-dir", run_dir, "--max-model-len", str(max_len), "--keep-logs",
               "--startup-timeout", "240"]
    log_path = os.path.join(run.work_dir, "serve.log")
    log(run, f"serve: {' '.join(command)}")
    server = start_process(run, command, log_path)
    try:
        ready_s = wait_ready(run, server, log_path, timeout_s=270)
        log(run, f"serve: ready after {ready_s:.0f} s; pagoda bench serve next")
        summary = bench_serve(run, f"http://127.0.0.1:{port}", folder)
    except Exception:
        keep_serve_logs(run, log_path, run_dir)
        raise
    finally:
        stop_process(run, server)
    run.raw["serve"] = dict(ready_s=ready_s, summary=summary)
    ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
    result = (f"{num(summary['output_throughput'])} output tok/s; TTFT p50 "
              f"{fmt_ms(ttft['p50'])} / p99 {fmt_ms(ttft['p99'])} ms; TPOT p50 "
              f"{fmt_ms(tpot['p50'])} / p99 {fmt_ms(tpot['p99'])} ms "
              f"({summary['completed']}/{p.serve_prompts} completed, {p.serve_input_len} in -> "
              f"{p.serve_output_len} out, all at once; stack ready in {ready_s:.0f} s)")
    log(run, f"serve: {result}")
    failed = summary["failed"] > 0
    return [Row("serve", f"{spec.name} pagoda serve --device {p.device}", result,
                "every request completed", "FAILED" if failed else "ok")]


def fmt_ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def build_folder(run: Run, device, spec: ModelSpec) -> str:
    import torch
    log(run, f"serve: creating the random {spec.name} model")
    model = random_model(hf_config("llama", spec.config), torch.bfloat16, device, seed=22)
    folder = save_folder(run, model, f"model-{spec.name}")
    del model
    free_device_memory(device)
    run.folders[spec.name] = folder
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(run: Run, command: list, log_path: str) -> subprocess.Popen:
    """A child in its own process group, its output in log_path, stopped at any exit."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    run.children.append(proc)
    return proc


def stop_process(run: Run, proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (pagoda serve stops its stack in order), then SIGKILL to the group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc in run.children:
        run.children.remove(proc)


def wait_ready(run: Run, proc: subprocess.Popen, log_path: str, timeout_s: float) -> float:
    """Seconds until `pagoda serve` prints its ready banner; an error if it exits first."""
    start = time.monotonic()
    last_note = start
    while time.monotonic() - start < timeout_s:
        with open(log_path, errors="replace") as f:
            text = f.read()
        if "pagoda: ready" in text:
            return time.monotonic() - start
        if proc.poll() is not None:
            raise RuntimeError(f"pagoda serve exited ({proc.returncode}) before it was ready: "
                               f"{tail(text, 6)}")
        if time.monotonic() - last_note > 30:
            log(run, f"serve: still starting ({time.monotonic() - start:.0f} s)")
            last_note = time.monotonic()
        time.sleep(1.0)
    raise TimeoutError(f"pagoda serve not ready after {timeout_s:.0f} s")


def tail(text: str, lines: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def bench_serve(run: Run, base_url: str, tokenizer: str) -> dict:
    """`pagoda bench serve` as a user runs it -> its summary at rate inf."""
    p = run.plan
    out_json = os.path.join(run.work_dir, "bench_serve.json")
    command = [sys.executable, "-m", "pagoda", "bench", "serve", "--base-url", base_url,
               "--num-prompts", str(p.serve_prompts), "--input-len", str(p.serve_input_len),
               "--output-len", str(p.serve_output_len), "--request-rate", "inf",
               "--tokenizer", tokenizer, "--timeout", "150", "--output-json", out_json]
    log(run, f"serve: {' '.join(command[3:])}")
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    for line in done.stdout.strip().splitlines():
        log(run, f"serve: | {line}")
    if done.returncode != 0:
        raise RuntimeError(f"pagoda bench serve exited {done.returncode}: "
                           f"{tail(done.stderr or done.stdout, 6)}")
    with open(out_json) as f:
        return json.load(f)["summaries"][0]


def keep_serve_logs(run: Run, log_path: str, run_dir: str) -> None:
    """A failed serve's logs, beside the results (pagoda serve's own and the worker's)."""
    for path in (log_path, os.path.join(run_dir, "logs", "worker-0.log")):
        if os.path.isfile(path):
            with contextlib.suppress(OSError):
                shutil.copy(path, os.path.join(run.results_dir,
                                               "gpu_check_" + os.path.basename(path)))
