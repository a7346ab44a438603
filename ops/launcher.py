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
"""
import ctypes
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields

from shared.config import EngineArgs
from shared.curve import CurveKeys
from shared.logging import get_logger
from shared.placement import parse_cpu_list, rank_cpus
from shared.sockets import free_tcp_ports, probe_health
from shared.stack_config import StackConfig, default_run_dir
from ops.compose import ServiceSpec, default_compose_file, load_services

log = get_logger("launcher")

# StackConfig fields that name sockets or hosts of one deployment; the launcher sets its own.
_LOCAL_FIELDS = ("run_dir", "request_input", "tokenizer_input", "engine_input", "worker_addr",
                 "detokenizer_addr", "control_addr", "engine_control", "return_host", "replica",
                 "dist_init_addr")
_LOCAL_ENV = {"PAGODA_" + name.upper() for name in _LOCAL_FIELDS}
# What the launcher's own StackConfig decides for every process (its sockets, and --curve-keys-dir);
# its other fields come from this environment only, so the compose file's values (from `.env`,
# say) win over them.
_LAUNCHER_ENV = _LOCAL_ENV | {"PAGODA_CURVE_KEYS_DIR"}

_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the launcher dies, even by SIGKILL."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LaunchError(RuntimeError):
    """A service failed to start or kept failing; the message names it and quotes its log."""

    def __init__(self, service: str, reason: str, log_tail: str = ""):
        message = f"{service}: {reason}"
        if log_tail:
            message += f"\n--- last lines of its log ---\n{log_tail}"
        super().__init__(message)
        self.service = service
        self.reason = reason
        self.log_tail = log_tail


@dataclass
class ServiceProcess:
    """One process of the stack: how to start it, and the running Popen."""
    service: str  # compose service name
    index: int  # among the service's processes (an engine's: its replica)
    argv: list[str]
    env: dict[str, str]
    log_path: str
    control_addr: str
    popen: subprocess.Popen | None = None
    restarts: deque = field(default_factory=deque)  # monotonic times of automatic restarts
    healthy: bool = False
    last_answer: float = 0.0  # monotonic time of its last probe answer (or of its start)
    replica: int = 0  # the engine replica of an engine or worker

    @property
    def name(self) -> str:
        return f"{self.service}-{self.index}"

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        # Progress bars redraw with \r: keep what a terminal would show.
        shown = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
        return "\n".join([line for line in shown if line.strip()][-lines:])


def local_stack_config(run_dir: str) -> StackConfig:
    """The default ipc layout in `run_dir`, whatever PAGODA_* addresses this environment holds
    (the same file names a bare `StackConfig()` uses, so default clients find the stack)."""
    return StackConfig.ignoring_env(_LOCAL_FIELDS, run_dir=run_dir)


def use_tcp_ports(stack: StackConfig, host: str) -> None:
    """Put the addresses the engine binds on free tcp ports of `host` (clients then return
    over tcp too)."""
    names = ("request_input", "tokenizer_input", "engine_input", "worker_addr",
             "detokenizer_addr", "engine_control")
    ports = iter(free_tcp_ports(host, len(names) * stack.num_replicas))
    for name in names:
        stack.set_replica_addresses(name, [f"tcp://{host}:{next(ports)}"
                                           for _ in range(stack.num_replicas)])
    stack.return_host = host


def engine_arg_flags(engine_args: dict) -> list[tuple[str, list[str]]]:
    """EngineArgs values -> (flag, tokens) pairs; None values are left to each service's default."""
    known = {f.name for f in fields(EngineArgs)}
    out = []
    for name, value in engine_args.items():
        if name not in known:
            raise ValueError(f"unknown engine argument {name!r}")
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append((flag, [flag if value else "--no-" + flag[2:]]))
        else:
            out.append((flag, [flag, str(value)]))
    return out


def accepted_flags(command: str) -> set[str]:
    """The option strings `pagoda <command>` accepts, from its own argument parser."""
    import argparse
    import importlib

    from pagoda.cli import COMMANDS
    if command not in COMMANDS:
        raise LaunchError(command, f"pagoda has no `{command}` command")
    parser = argparse.ArgumentParser(add_help=False)
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return {s for action in parser._actions for s in action.option_strings}


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
        self.replicas = _replica_count(self.specs, self.engine_args.get("data_parallel_size"))
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
                self._spawn(m)
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
                    self._spawn(m)
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
                    _signal_group(m.popen, signal.SIGKILL)
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
        self._terminate([m])
        m.healthy = False
        return self._spawn(m)

    def stop(self) -> None:
        """SIGTERM every process, SIGKILL what is left after the grace period, remove the
        sockets and (unless `keep_logs`) the logs; the run directory goes if it is then empty."""
        if self._stopped:
            return
        self._stopped = True
        self._terminate(self.members)
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
        specs = self.specs
        for needed in ("engine", "worker", "tokenizer", "detokenizer"):
            if not any(s.command == needed for s in specs.values()):
                raise LaunchError(needed, f"no service runs `pagoda {needed}` in {self.compose_file}")
        if self.gateway and not any(s.command == "gateway" for s in specs.values()):
            raise LaunchError("gateway", f"no service runs `pagoda gateway` in {self.compose_file}")
        for spec in specs.values():
            count = self.counts.get(spec.command, 1)
            if count == 0:
                continue
            flags = accepted_flags(spec.command)
            if spec.command not in _PER_REPLICA:
                replicas = [0]
            elif "PAGODA_REPLICA" in spec.environment:  # the file lists its replicas
                replicas = [int(spec.environment["PAGODA_REPLICA"])]
            else:
                replicas = list(range(self.replicas))
            for replica in replicas:
                for rank in range(count):
                    index = (replica - replicas[0]) * count + rank
                    self.members.append(self._member_for(spec, index, flags, replica, rank))

    def _member_for(self, spec: ServiceSpec, index: int, flags: set[str], replica: int = 0,
                    rank: int = 0) -> ServiceProcess:
        args = list(spec.args)
        if "--instance" in flags:
            args += ["--instance", str(index)]
        elif "--rank" in flags:
            args += ["--rank", str(rank)]
        else:
            assert rank == 0, f"`pagoda {spec.command}` has no --instance or --rank flag"
        # Later flags win in argparse: the launch's own values override the compose file's.
        for flag, tokens in engine_arg_flags(self.engine_args):
            if flag in flags or tokens[0] in flags:
                args += tokens
        if spec.command == "gateway":
            args += ["--host", self.host, "--port", str(self.port)]
            if self.api_key:
                args += ["--api-key", self.api_key]
            if self.served_model_names:
                args += ["--served-model-name", *self.served_model_names]
        env = {k: v for k, v in os.environ.items() if k not in _LOCAL_ENV}
        env.update({k: v for k, v in spec.environment.items() if k not in _LOCAL_ENV})
        env.update({k: v for k, v in self.stack_config.to_env().items()
                    if k in _LAUNCHER_ENV or k not in env})
        env.update(PYTHONUNBUFFERED="1", **self.extra_env)
        env["PAGODA_REPLICA"] = str(replica)
        ranks = self.counts["worker"]
        if spec.command == "worker" and self.replicas * ranks > 1:
            # Each worker process its own share of the workers' CPUs (those given, else this
            # host's): first by replica, then by rank. Workers whose OpenMP threads share cores
            # wait at every barrier for a preempted peer, and a tensor-parallel group meets at
            # every layer's sum.
            cpus = parse_cpu_list(env.get("PAGODA_CPUS", "").strip()
                                  or ",".join(map(str, sorted(os.sched_getaffinity(0)))))
            share = rank_cpus(rank_cpus(cpus, replica, self.replicas), rank, ranks)
            env["PAGODA_CPUS"] = ",".join(map(str, share))
        if spec.command == "worker" and ranks > 1:
            env["PAGODA_DIST_INIT_ADDR"] = self.dist_init_addrs[replica]
        instance = rank if spec.command in _PER_REPLICA else index
        return ServiceProcess(
            service=spec.name, index=index,
            argv=[sys.executable, "-m", "pagoda", spec.command, *args], env=env,
            log_path=os.path.join(self.log_dir, f"{spec.name}-{index}.log"),
            control_addr=self.stack_config.for_replica(replica).control_for(spec.command,
                                                                            instance),
            replica=replica)

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

    def _spawn(self, m: ServiceProcess) -> subprocess.Popen:
        with open(m.log_path, "ab") as log_file:
            # Own session: a terminal's Ctrl-C reaches the launcher only, which stops
            # everything in order; pdeathsig covers a launcher that is killed outright.
            m.popen = subprocess.Popen(m.argv, env=m.env, stdin=subprocess.DEVNULL,
                                       stdout=log_file, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=_die_with_parent)
        m.last_answer = time.monotonic()  # a start is not a hang
        log.debug("process started", process=m.name, pid=m.popen.pid)
        return m.popen

    def _terminate(self, members: list[ServiceProcess]) -> None:
        alive = [m for m in members if m.popen is not None and m.popen.poll() is None]
        for m in alive:
            _signal_group(m.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for m in alive:
            try:
                m.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("process ignored SIGTERM; killing it", process=m.name)
                _signal_group(m.popen, signal.SIGKILL)
                m.popen.wait()
        for m in alive:
            _signal_group(m.popen, signal.SIGKILL)  # whatever the process itself started

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


_PER_REPLICA = ("engine", "worker")  # the services each engine replica has its own of


def _replica_count(specs: dict[str, ServiceSpec], data_parallel_size: int | None) -> int:
    """How many engine replicas: those the compose file lists (services that set
    PAGODA_REPLICA), else `data_parallel_size`; both given, they must agree."""
    listed = {int(s.environment["PAGODA_REPLICA"]) for s in specs.values()
              if s.command == "engine" and "PAGODA_REPLICA" in s.environment}
    if data_parallel_size is not None and data_parallel_size < 1:
        raise ValueError(f"data_parallel_size: must be at least 1, got {data_parallel_size}")
    if not listed:
        return data_parallel_size or 1
    if listed != set(range(len(listed))):
        raise ValueError(f"the compose file's engine replicas are {sorted(listed)}; "
                         f"they must be 0..{len(listed) - 1}")
    if data_parallel_size not in (None, len(listed)):
        raise ValueError(f"data_parallel_size {data_parallel_size}, but the compose file "
                         f"lists {len(listed)} engine replicas")
    return len(listed)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
