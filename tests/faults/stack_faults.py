"""Helpers of the fault tests: a supervised stack, streams that record what they got, waits, and
the requests every fault test streams (`PAGODA_FAULT_REQUESTS` of them, default 32;
`PAGODA_FAULT_KEEP_LOGS=1` keeps the processes' logs)."""
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

NUM_REQUESTS = int(os.environ.get("PAGODA_FAULT_REQUESTS", "32"))
KEEP_LOGS = bool(os.environ.get("PAGODA_FAULT_KEEP_LOGS"))
MAX_TOKENS = 24
LIVENESS_S = 4.0  # heartbeat timeout of the stack: how soon a dead peer is noticed
STEP_TIMEOUT_S = 6.0  # a step in flight this long with no output: its worker is stuck
HANG_TIMEOUT_S = 10.0  # a process answering no probe this long is killed by the launcher
ACK_TIMEOUT_S = 2.0
ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_model_len": 2048}
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SUBJECTS = ["the sea", "a mountain", "the moon", "a library", "coffee", "winter", "a robot",
            "the city at night"]
PROMPTS = [f"Request {i}: write one sentence about {SUBJECTS[i % len(SUBJECTS)]}."
           for i in range(NUM_REQUESTS)]


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


def new_client(stack: SupervisedStack) -> AsyncEngineClient:
    return AsyncEngineClient(stack.stack.stack_config, output_timeout_s=90,
                             ack_timeout_s=ACK_TIMEOUT_S, max_resubmits=5,
                             engine_timeout_s=LIVENESS_S, probe_interval_s=0.5)


async def run_requests(client, tag: str, fault=None, before=None) -> list[StreamResult]:
    """Stream every prompt at once; `fault(results)` runs beside them (it kills something),
    `before()` before they are sent."""
    if before is not None:
        before()
    results = [StreamResult(f"{tag}-{i}") for i in range(NUM_REQUESTS)]
    streams = [stream_request(client, p, PARAMS, r.request_id, r)
               for p, r in zip(PROMPTS, results)]
    if fault is not None:
        streams.append(fault(results))
    await asyncio.wait_for(asyncio.gather(*streams), timeout=240)
    return results


def assert_same_as_baseline(results: list[StreamResult], baseline: list[StreamResult]) -> None:
    for got, want in zip(results, baseline):
        assert got.error is None, (got.request_id, got.error)
        assert got.token_ids == want.token_ids, got.request_id
        assert got.text == want.text, got.request_id
        assert got.finish_reason == want.finish_reason, got.request_id


def generation_tokens(stack) -> int:
    return int(stack.engine_details()["generation_tokens"])


def faulted_run(stack, tag: str, fault, before=None
                ) -> tuple[list[StreamResult], int, AsyncEngineClient]:
    """Run the requests beside `fault`; returns the results, the tokens the engine generated
    meanwhile, and the (closed) client."""
    stack.wait_healthy()
    tokens_before = generation_tokens(stack)
    engine = stack.stack._member("engine", 0)
    engine_pid = engine.popen.pid

    async def main():
        client = new_client(stack)
        try:
            return await run_requests(client, tag, fault, before), client
        finally:
            client.close()
    results, client = asyncio.run(main())
    stack.wait_healthy()
    # The fault is another process's: the engine must ride it out, not restart.
    assert engine.popen.pid == engine_pid, (
        f"the engine exited during the {tag} fault; the end of its log:\n"
        + engine.log_tail(200))  # the new engine's start-up, and the crash before it
    return results, generation_tokens(stack) - tokens_before, client


def mid_stream(results: list[StreamResult], min_tokens: int = 4):
    """True once every request has some output and none has finished."""
    return lambda: all(len(r.token_ids) >= min_tokens for r in results)
