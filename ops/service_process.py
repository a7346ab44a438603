"""The processes of a LocalStack: one process's command, environment, log and Popen
(`ServiceProcess`), how it is started and stopped, and `LaunchError`.

Each process runs in its own session and its own process group, which is what is signalled;
PR_SET_PDEATHSIG sends it SIGTERM when the launcher's thread that started it ends.
"""
import ctypes
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

from shared.logging import get_logger

log = get_logger("launcher")

_PR_SET_PDEATHSIG = 1
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def die_with_parent() -> None:
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

    def spawn(self) -> subprocess.Popen:
        """Start the process (again), its output appended to its log file."""
        with open(self.log_path, "ab") as log_file:
            # Own session: a terminal's Ctrl-C reaches the launcher only, which stops
            # everything in order; pdeathsig covers a launcher that is killed outright.
            self.popen = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL,
                                          stdout=log_file, stderr=subprocess.STDOUT,
                                          start_new_session=True, preexec_fn=die_with_parent)
        self.last_answer = time.monotonic()  # a start is not a hang
        log.debug("process started", process=self.name, pid=self.popen.pid)
        return self.popen


def terminate(members: list[ServiceProcess], grace_s: float) -> None:
    """SIGTERM the running ones, SIGKILL those still there after `grace_s`, then SIGKILL each
    one's process group (whatever the processes themselves started)."""
    alive = [m for m in members if m.popen is not None and m.popen.poll() is None]
    for m in alive:
        signal_group(m.popen, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for m in alive:
        try:
            m.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("process ignored SIGTERM; killing it", process=m.name)
            signal_group(m.popen, signal.SIGKILL)
            m.popen.wait()
    for m in alive:
        signal_group(m.popen, signal.SIGKILL)  # whatever the process itself started


def signal_group(popen: subprocess.Popen, sig: int) -> None:
    """`sig` to the process's group (its session: the process and what it started)."""
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
