"""The servers that `pagoda bench serve --baseline ...` starts and stops itself, one at a time:
`pagoda serve` and `vllm serve`, each with its log in the run folder, ready once `/v1/models`
answers, and stopped with its whole process tree (each in its own process group and with a
death signal on the benchmark's exit, so none outlives it)."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

from ops.bench.processes import (cpu_by_pid, die_with_parent, pagoda_role, process_tree,
                                 vllm_role)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags(engine_args: dict) -> list[str]:
    """`pagoda serve` flags for the engine arguments the user set (name -> value)."""
    flags = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


class ManagedServer:
    """One server process tree; `start` -> `wait_ready` -> passes -> `stop`."""

    name = ""

    def __init__(self, command: list[str], env: dict, log_path: str, port: int):
        self.command, self.env, self.log_path, self.port = command, env, log_path, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=die_with_parent)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the server is ready; an error if it exits first."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before it was "
                                   f"ready: {self.log_tail()}")
            if self.is_ready():
                return time.monotonic() - start
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s: {self.log_tail()}")

    def is_ready(self) -> bool:
        """`/v1/models` answers 200."""
        import httpx
        try:
            return httpx.get(self.base_url + "/v1/models", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 6) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def cpu_snapshot(self) -> dict[int, tuple[str, float]]:
        return cpu_by_pid(self.proc.pid, self.role_of)

    def role_of(self, argv: list[str], is_root: bool) -> str:
        raise NotImplementedError

    def stop(self, grace_s: float = 60.0, sig: int = signal.SIGINT) -> None:
        """`sig` to the server, then SIGKILL to every process of its tree (taken before the
        signal, since a child whose parent exits leaves the tree) and of its group."""
        if self.proc is None:
            return
        tree = process_tree(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        tree = sorted(set(tree) | set(process_tree(self.proc.pid)))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in tree) \
                and time.monotonic() < deadline:
            time.sleep(0.1)  # fully gone before the next system starts
        self.proc = None

    def health(self) -> dict | None:
        return None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class PagodaServer(ManagedServer):
    """`python -m pagoda serve` with the user's engine flags; its worker's health gives busy,
    idle and step counts."""

    name = "pagoda"

    def __init__(self, engine_args: dict, run_dir: str, tag: str,
                 serve_args: list[str] | None = None):
        self.stack_dir = os.path.join(run_dir, f"pagoda-{tag}")
        port = free_port()
        command = [sys.executable, "-m", "pagoda", "serve", "--port", str(port), "--run-dir",
                   self.stack_dir, "--keep-logs", *(serve_args or []), *engine_flags(engine_args)]
        super().__init__(command, dict(os.environ), os.path.join(run_dir, f"pagoda-{tag}.log"),
                         port)

    def is_ready(self) -> bool:
        """Its banner says every service is ready (the gateway answers `/v1/models` before
        the engine is), and `/v1/models` answers."""
        try:
            with open(self.log_path, errors="replace") as f:
                if "pagoda: ready" not in f.read():
                    return False
        except OSError:
            return False
        return super().is_ready()

    def role_of(self, argv: list[str], is_root: bool) -> str:
        return pagoda_role(argv, is_root)

    def health(self) -> dict | None:
        """The worker's busy_s, idle_s and steps so far (None when it does not answer)."""
        from shared.sockets import probe_health
        from shared.stack_config import StackConfig
        answer = probe_health(StackConfig(run_dir=self.stack_dir).control_for("worker", 0), 5)
        if answer is None:
            return None
        return {k: answer.details.get(k) for k in ("busy_s", "idle_s", "steps")}


def omp_threads_bind(env: dict) -> str | None:
    """vLLM's CPU build keeps a core for its scheduler unless told which to use; it runs its
    OpenMP threads on every core this process may use, as pagoda's do (unless set already)."""
    if "VLLM_CPU_OMP_THREADS_BIND" in env:
        return env["VLLM_CPU_OMP_THREADS_BIND"]
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return None


class VllmServer(ManagedServer):
    """`vllm serve` on the model's Hugging Face folder, run by vLLM's own interpreter through
    ops/bench/vllm_cli.py, with pagoda's dtype, lengths, batch and KV cache size."""

    name = "vllm"

    def __init__(self, python: str, folder: str, settings: dict, run_dir: str, tag: str):
        port = free_port()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cli.py")
        command = [python, script, "serve", folder, "--port", str(port),
                   "--host", "127.0.0.1", "--dtype", settings["dtype"],
                   "--max-model-len", str(settings["max_model_len"]),
                   "--max-num-seqs", str(settings["max_num_seqs"]),
                   "--served-model-name", settings["served_model_name"], "--seed", "0"]
        # (Request logging is off unless --enable-log-requests: this version has no
        # --disable-log-requests.)
        if settings.get("max_num_batched_tokens"):
            command += ["--max-num-batched-tokens", str(settings["max_num_batched_tokens"])]
        if settings.get("enable_prefix_caching") is False:
            command.append("--no-enable-prefix-caching")
        env = dict(os.environ)
        if settings["device"] == "cpu":
            env["VLLM_TARGET_DEVICE"] = "cpu"
            env["VLLM_CPU_KVCACHE_SPACE"] = str(settings["kv_cache_space_gib"])
            bind = omp_threads_bind(env)
            if bind:
                env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        elif settings.get("gpu_memory_utilization"):
            command += ["--gpu-memory-utilization", str(settings["gpu_memory_utilization"])]
        self.settings = {**settings, "omp_threads_bind": env.get("VLLM_CPU_OMP_THREADS_BIND")}
        super().__init__(command, env, os.path.join(run_dir, f"vllm-{tag}.log"), port)

    def role_of(self, argv: list[str], is_root: bool) -> str:
        return vllm_role(argv, is_root)

    def stop(self, grace_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
        super().stop(grace_s, sig)
