"""LocalStack: the services of docker-compose.yml as local processes on ipc sockets.

`pagoda serve`, the tests and the benchmarks use it. Each compose service whose command is
`pagoda <service> ...` becomes one process per instance (`python -m pagoda <service> ...`), with
the service's environment from the compose file except the socket addresses, which become ipc
files in one run directory (nothing binds to a network interface but the gateway's HTTP port).

    with LocalStack(gateway=False, tokenizers=2) as stack:   # returns when every probe says ok
        client = AsyncEngineClient(stack.stack_config)

`tcp_host` puts the engine's addresses on tcp ports of that host instead (as across hosts);
`curve_keys_dir` (or PAGODA_CURVE_KEYS_DIR) turns CurveZMQ on for every process and probe.

Data parallelism: `engine_args["data_parallel_size"]` = K starts the compose file's engine and
worker services K times, one engine and its `tensor_parallel_size` workers per replica
(`PAGODA_REPLICA`), with each replica's own addresses; the tokenizers, detokenizers and gateway
serve them all. A compose file that lists its replicas itself (services that set
PAGODA_REPLICA, as docker-compose.dp2.yml does) gets each of them started once.

Which processes, with which arguments and environment: ops/launch_plan.py. Starting and stopping
one process, and LaunchError: ops/service_process.py. This module runs the stack: start, wait
until ready, supervise, stop.
"""
import os
import shutil
import signal
import stat
import subprocess
import threading
import time

from shared.curve import CurveKeys
from shared.logging import get_logger
from shared.sockets import free_tcp_ports, probe_health
from shared.stack_config import default_run_dir
from ops.compose import default_compose_file, load_services
from ops.launch_plan import local_stack_config, plan_processes, replica_count, use_tcp_ports
from ops.service_process import LaunchError, ServiceProcess, signal_group, terminate

log = get_logger("launcher")


class LocalStack:
    """The stack of a compose file as local processes, each in its own session.

    A process gets SIGTERM when the thread that started it ends (so none outlives a launcher
    that is killed): call `start`, `restart` and `supervise` from a thread that lives as long
    as the stack, normally the main thread.
    """

    def __init__(self, compose_file: str | list[str] | None = None,
                 engine_args: dict | None = None,
                 tokenizers: int = 1, detokenizers: int = 1, run_dir: str | None = None,
                 host: str = "127.0.0.1", port: int = 8000, gateway: bool = True,
                 api_key: str | None = None, env: dict[str, str] | None = None,
                 verbose: bool = False, keep_logs: bool = False,
                 max_restarts_per_minute: int = 3, stop_grace_s: float = 10.0,
                 tcp_host: str | None = None, curve_keys_dir: str | None = None,
                 hang_timeout_s: float = 60.0, served_model_names: list[str] | None = None,
                 compose_vars: dict[str, str] | None = None):
        """`env` is added to every process's environment (after the compose file's).
        `verbose` echoes every process's log lines to stdout with a `[service-i]` prefix.
        `tcp_host`: the engine binds tcp ports of this host rather than ipc files.
        `curve_keys_dir` (default: PAGODA_CURVE_KEYS_DIR): CurveZMQ keys for every socket;
        a bad directory raises CurveKeysError here, before anything starts.
        `hang_timeout_s`: a process that answers no probe for this long (stopped, or stuck
        with its control thread), or answers "stuck" for this long (a worker inside one step
        for longer than the step timeout), is killed, and so restarted; 0 turns that off.
        `served_model_names`: the gateway's --served-model-name (default: the compose file's
        PAGODA_SERVED_MODEL_NAME, else the model's name).
        `compose_vars`: variables for the compose file's interpolation, over the environment's
        (`pagoda serve --worker-cpus` sets PAGODA_WORKER_CPUS this way).
        `compose_file` may list several files, merged as compose merges them."""
        if tokenizers < 1 or detokenizers < 1:
            raise ValueError("a stack needs at least one tokenizer and one detokenizer")
        files = ([compose_file] if isinstance(compose_file, str)
                 else list(compose_file or [default_compose_file()]))
        self.compose_file = " + ".join(files)  # for messages
        self.engine_args = dict(engine_args or {})
        self.compose_vars = dict(compose_vars or {})
        self.specs = load_services(files, {**os.environ, **self.compose_vars})
        self.replicas = replica_count(self.specs, self.engine_args.get("data_parallel_size"))
        # Per replica: an engine and its workers.
        self.counts = {"tokenizer": tokenizers, "detokenizer": detokenizers, "engine": 1,
                       "worker": int(self.engine_args.get("tensor_parallel_size") or 1),
                       "gateway": 1 if gateway else 0}
        self.run_dir = os.path.abspath(run_dir or os.environ.get("PAGODA_RUN_DIR")
                                       or default_run_dir())
        self.stack_config = local_stack_config(self.run_dir)
        self.stack_config.use_replicas(self.replicas)
        if tcp_host:
            use_tcp_ports(self.stack_config, tcp_host)
        # Each replica's tensor-parallel group meets on a port of its own (rank 0 hosts it).
        self.dist_init_addrs = ([f"tcp://{tcp_host or '127.0.0.1'}:{port}"
                                 for port in free_tcp_ports(tcp_host or "127.0.0.1",
                                                            self.replicas)]
                                if self.counts["worker"] > 1 else [])
        keys_dir = curve_keys_dir or self.stack_config.curve_keys_dir
        self.stack_config.curve_keys_dir = os.path.abspath(keys_dir) if keys_dir else ""
        self.curve: CurveKeys | None = self.stack_config.curve  # for the launcher's own probes
        self.host, self.port, self.gateway, self.api_key = host, port, gateway, api_key
        self.served_model_names = list(served_model_names or [])
        self.gateway_url = f"http://{host}:{port}" if gateway else None
        self.extra_env = dict(env or {})
        self.verbose = verbose
        self.keep_logs = keep_logs
        self.max_restarts_per_minute = max_restarts_per_minute
        self.stop_grace_s = stop_grace_s
        self.hang_timeout_s = hang_timeout_s
        self.log_dir = os.path.join(self.run_dir, "logs")
        self.members: list[ServiceProcess] = []
        self._echo_stop = threading.Event()
        self._echo_thread: threading.Thread | None = None
        self._started = False
        self._owns_run_dir = False  # set once no other stack was found there
        self._stopped = False

    # -- public API ----------------------------------------------------------------------------
    @property
    def processes(self) -> dict[str, list[subprocess.Popen]]:
        out: dict[str, list[subprocess.Popen]] = {}
        for m in self.members:
            out.setdefault(m.service, []).append(m.popen)
        return out

    def start(self, timeout_s: float = 300.0, on_progress=None) -> "LocalStack":
        """Start every process and return once all are ready; on failure stop them all and
        raise LaunchError naming the service. `on_progress(ready, waiting)` gets name lists."""
        assert not self._started, "a LocalStack starts once"
        self._started = True
        try:
            self._prepare_run_dir()
            self._plan()
            for m in self.members:
                m.spawn()
            if self.verbose:
                self._echo_thread = threading.Thread(target=self._echo_logs, daemon=True,
                                                     name="log-echo")
                self._echo_thread.start()
            self.wait_ready(timeout_s, on_progress)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = 300.0, on_progress=None) -> None:
        """Until every process's probe says ok and the engine counts every peer; raises
        LaunchError when a process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        last_report = None
        for m in self.members:
            m.healthy = False
        while True:
            for m in self.members:
                code = m.popen.poll()
                if code is not None:
                    raise LaunchError(m.name, f"exited with code {code} while starting",
                                      m.log_tail())
            for m in self.members:
                if not m.healthy:
                    health = probe_health(m.control_addr, timeout_s=0.5, curve=self.curve)
                    m.healthy = health is not None and health.status == "ok"
            missing = self._missing_peers() if all(m.healthy for m in self.members) else None
            ready = [m.name for m in self.members if m.healthy]
            waiting = [m.name for m in self.members if not m.healthy]
            if missing == []:
                if on_progress:
                    on_progress(ready, [])
                return
            if missing:
                waiting = missing
            if on_progress and (ready, waiting) != last_report:
                on_progress(ready, waiting)
                last_report = (ready, waiting)
            if time.monotonic() > deadline:
                late = next((m for m in self.members if not m.healthy), None)
                if late is None:
                    raise LaunchError("engine", f"ready, but still waiting for "
                                                f"{', '.join(missing)} after {timeout_s:.0f} s")
                raise LaunchError(late.name, f"not ready within {timeout_s:.0f} s",
                                  late.log_tail())
            time.sleep(0.5)

    def supervise(self, stop: threading.Event, check_every_s: float = 3.0) -> None:
        """The liveness loop, until `stop` is set: restarts a process that exited (at most
        `max_restarts_per_minute` per process, then raises LaunchError), kills one that has
        hung for `hang_timeout_s` (it is restarted on the next round), and logs
        probes that start or stop failing."""
        while not stop.wait(check_every_s):
            for m in self.members:
                code = m.popen.poll()
                if code is not None:
                    now = time.monotonic()
                    while m.restarts and now - m.restarts[0] > 60:
                        m.restarts.popleft()
                    if len(m.restarts) >= self.max_restarts_per_minute:
                        raise LaunchError(m.name, f"exited with code {code}, after "
                                                  f"{len(m.restarts)} restarts in a minute",
                                          m.log_tail())
                    m.restarts.append(now)
                    log.warning("process exited; restarting", process=m.name, code=code,
                                log_file=m.log_path)
                    m.spawn()
                    m.healthy = False
                    continue
                health = probe_health(m.control_addr, timeout_s=1.0, curve=self.curve)
                healthy = health is not None and health.status == "ok"
                if healthy != m.healthy:
                    log.info("process ready" if healthy else "process not answering probes",
                             process=m.name,
                             status=health.status if health else "no answer")
                m.healthy = healthy
                now = time.monotonic()
                if health is not None and health.status != "stuck":
                    m.last_answer = now
                elif self.hang_timeout_s and now - m.last_answer > self.hang_timeout_s:
                    # Alive but silent (SIGSTOP, a deadlock) or stuck: only a restart helps.
                    log.error("process hung; killing it", process=m.name,
                              status=health.status if health else "no answer",
                              since_s=round(now - m.last_answer, 1))
                    signal_group(m.popen, signal.SIGKILL)
                    m.popen.wait()

    def kill(self, service: str, index: int = 0, sig: int = signal.SIGKILL) -> subprocess.Popen:
        """Send `sig` to one process (fault tests); a SIGKILL is waited for."""
        m = self._member(service, index)
        if m.popen.poll() is None:
            os.kill(m.popen.pid, sig)
            if sig == signal.SIGKILL:
                m.popen.wait()
        return m.popen

    def restart(self, service: str, index: int = 0) -> subprocess.Popen:
        """Stop one process (if it runs) and start it again; `wait_ready` waits for it."""
        m = self._member(service, index)
        terminate([m], self.stop_grace_s)
        m.healthy = False
        return m.spawn()

    def stop(self) -> None:
        """SIGTERM every process, SIGKILL what is left after the grace period, remove the
        sockets and (unless `keep_logs`) the logs; the run directory goes if it is then empty."""
        if self._stopped:
            return
        self._stopped = True
        terminate(self.members, self.stop_grace_s)
        self._echo_stop.set()
        if self._echo_thread is not None:
            self._echo_thread.join(timeout=2)
        if self._owns_run_dir:
            self._clean_run_dir()

    def __enter__(self) -> "LocalStack":
        return self if self._started else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- internals -----------------------------------------------------------------------------
    def _plan(self) -> None:
        """Turn each compose service into its processes' command lines and environments."""
        self.members.extend(plan_processes(self))

    def _member(self, service: str, index: int) -> ServiceProcess:
        for m in self.members:
            if m.service == service and m.index == index:
                return m
        raise KeyError(f"no process {service}-{index}")

    def _prepare_run_dir(self) -> None:
        running = probe_health(self.stack_config.engine_control, timeout_s=0.5, curve=self.curve)
        if running is not None:
            raise LaunchError("engine", f"a pagoda stack already runs in {self.run_dir} "
                                        f"(pid {running.details.get('pid')}); stop it or pass "
                                        f"another run directory")
        self._owns_run_dir = True
        os.makedirs(self.log_dir, exist_ok=True)
        self._remove_sockets()  # stale ones of a run that was killed

    def _remove_sockets(self) -> None:
        if not os.path.isdir(self.run_dir):
            return
        for name in os.listdir(self.run_dir):
            path = os.path.join(self.run_dir, name)
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass

    def _clean_run_dir(self) -> None:
        self._remove_sockets()
        if not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        try:
            os.rmdir(self.run_dir)  # only when empty: it may be a folder the user named
        except OSError:
            pass

    def _missing_peers(self) -> list[str]:
        """What each engine replica does not see yet, as 'N of M tokenizers' phrases."""
        missing = []
        for replica, addr in enumerate(self.stack_config.replica_addresses("engine_control")):
            which = f"replica {replica}: " if self.replicas > 1 else ""
            health = probe_health(addr, timeout_s=0.5, curve=self.curve)
            if health is None or health.status != "ok":
                missing.append(f"{which}the engine's health")
                continue
            for peer in ("tokenizer", "detokenizer", "worker"):
                seen = int(health.details.get(peer + "s", 0) or 0)
                if seen < self.counts[peer]:
                    missing.append(f"{which}{seen} of {self.counts[peer]} {peer}s registered")
        return missing

    def _echo_logs(self) -> None:
        offsets: dict[str, int] = {}
        partial: dict[str, bytes] = {}
        while not self._echo_stop.wait(0.2):
            for m in self.members:
                try:
                    with open(m.log_path, "rb") as f:
                        f.seek(offsets.get(m.log_path, 0))
                        data = f.read()
                        offsets[m.log_path] = f.tell()
                except OSError:
                    continue
                lines = (partial.get(m.log_path, b"") + data).split(b"\n")
                partial[m.log_path] = lines.pop()
                for line in lines:
                    text = line.decode(errors="replace").rsplit("\r", 1)[-1]
                    if text.strip():
                        print(f"[{m.name}] {text}", flush=True)

