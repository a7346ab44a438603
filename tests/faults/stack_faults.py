"""Helpers of the fault tests: a supervised stack, streams that record what they got, waits."""
import asyncio
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from ops.launcher import LocalStack
from services.gateway.client import AsyncEngineClient, EngineRequestError
from shared.sampling_params import SamplingParams
from shared.sockets import probe_health


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SupervisedStack:
    """A LocalStack whose `supervise` loop runs in a thread, so a killed process comes back.

    Supervision can be paused (a test that needs a service to stay down a while). The thread
    lives as long as the stack: the processes it restarted get SIGTERM when it ends.
    """

    def __init__(self, stack: LocalStack, check_every_s: float = 1.0):
        self.stack = stack
        self.check_every_s = check_every_s
        self.closing = threading.Event()
        self.round = threading.Event()  # set: the running supervise() call returns
        self.resumed = threading.Event()
        self.resumed.set()
        self.paused = threading.Event()  # set while no supervise() call runs
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._supervise, name="supervise", daemon=True)

    def _supervise(self) -> None:
        try:
            while True:
                self.resumed.wait()
                if self.closing.is_set():
                    return
                self.paused.clear()
                self.stack.supervise(self.round, self.check_every_s)  # until paused or closed
                self.paused.set()
        except BaseException as e:  # the test that waits on the stack reports it
            self.error = e
            self.paused.set()

    def pause(self) -> None:
        """Returns once supervision has stopped (a check under way is finished)."""
        self.resumed.clear()
        self.round.set()
        assert self.paused.wait(30), "supervision did not pause"

    def resume(self) -> None:
        if self.resumed.is_set():
            return  # running: its round must stay the one `stop` ends
        self.round = threading.Event()
        self.resumed.set()

    def start(self) -> "SupervisedStack":
        self.stack.start(timeout_s=300)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.closing.set()
        self.round.set()
        self.resumed.set()
        self.thread.join(timeout=10)
        self.stack.stop()

    def pids(self) -> dict[str, int]:
        return {m.name: m.popen.pid for m in self.stack.members}

    def kill(self, service: str, index: int = 0, sig: int = signal.SIGKILL) -> int:
        """Signal one process; returns its pid."""
        member = self.stack._member(service, index)
        pid = member.popen.pid
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            member.popen.wait()
        return pid

    def engine_details(self) -> dict:
        health = probe_health(self.stack.stack_config.engine_control, 5)
        return health.details if health is not None and health.status == "ok" else {}

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Until every process runs and answers ok, the engine counts every peer and has its
        workers (no recovery under way), and nothing is running or waiting."""
        deadline = time.monotonic() + timeout_s
        counts = self.stack.counts
        while True:
            assert self.error is None, f"supervision failed: {self.error}"
            problems = []
            for m in self.stack.members:
                if m.popen.poll() is not None:
                    problems.append(f"{m.name} exited")
                    continue
                health = probe_health(m.control_addr, 2)
                if health is None or health.status != "ok":
                    problems.append(f"{m.name} not ok")
            details = self.engine_details()
            for peer in ("tokenizer", "detokenizer", "worker"):
                if int(details.get(peer + "s", 0) or 0) < counts[peer]:
                    problems.append(f"engine sees {details.get(peer + 's')} {peer}s")
            if details.get("running") or details.get("waiting"):
                problems.append("requests still in the engine")
            if not problems:
                return
            assert time.monotonic() < deadline, f"stack not healthy in {timeout_s} s: {problems}"
            time.sleep(0.5)


@dataclass
class StreamResult:
    """What one streamed request delivered, in order."""
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: EngineRequestError | None = None
    ended_at: float = 0.0  # monotonic


async def stream_request(client: AsyncEngineClient, prompt, params: SamplingParams,
                         request_id: str, result: StreamResult) -> StreamResult:
    try:
        async for out in client.generate(prompt, params, request_id=request_id):
            c = out.outputs[0] if out.outputs else None
            if c is not None:
                result.text += c.text
                result.token_ids += c.token_ids
                result.finish_reason = c.finish_reason or result.finish_reason
    except EngineRequestError as e:
        result.error = e
    result.ended_at = time.monotonic()
    return result


async def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(poll_s)
