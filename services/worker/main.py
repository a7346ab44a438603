"""`pagoda worker`: one device's Worker behind a ZMQ DEALER socket connected to the engine.

With tensor_parallel_size > 1 each rank is one such process. Every rank registers and
heartbeats, so the engine sees the whole group, but steps and setup calls come to rank 0 only,
which relays them to the others over the group (services/worker/distributed.py). When the
group breaks (a rank died) the process exits with code 3, and the restarted processes form it
again; the engine meanwhile recovers as from any worker's death.
"""
import argparse
import signal
from collections import deque
import threading
import time

import zmq

from proto.codec import CodecError, decode, encode
from proto.control import Register, WorkerCall, WorkerReply
from proto.messages import ExecuteModelRequest
from proto.requests import ErrorResponse
from shared.engine_args import EngineArgs
from shared.gc_freeze import freeze_startup_objects
from shared.logging import configure, get_logger
from shared.placement import placed_cpus, spread_this_thread
from shared.sockets import ControlServer, connect, make_socket, process_instance_id
from shared.stack_config import StackConfig
from services.worker.distributed import GroupBroken
from services.worker.model_runner import LaunchedStep

log = get_logger("worker")

GROUP_BROKEN_EXIT_CODE = 3
# The longest blocking wait: SIGTERM only sets a flag, and a zmq poll the signal interrupts
# resumes waiting, so waits as long as the re-registration period (a quarter of the liveness
# timeout: 15 s at 60 s) held the stop back past the launcher's grace period.
_STOP_CHECK_S = 0.5
# How often the socket is looked at while launched steps run on a GPU (their end is not a
# socket event): often enough that a step sent meanwhile starts as the running one ends.
_RUNNING_POLL_S = 2e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=int, default=0)
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    configure("worker")
    try:
        service = WorkerService(EngineArgs.from_cli_args(args), StackConfig.from_cli_args(args),
                                args.rank)
        service.serve()
    except GroupBroken as e:
        log.error("tensor-parallel group broken; exiting so that it forms again", rank=args.rank,
                  error=str(e))
        return GROUP_BROKEN_EXIT_CODE
    return 0


class WorkerService:
    def __init__(self, engine_args: EngineArgs, stack: StackConfig, rank: int = 0):
        from services.worker.worker import Worker
        self.stack = stack
        self.rank = rank
        self.instance_id = process_instance_id()
        self.ctx = zmq.Context()
        for cpu in placed_cpus() or ():
            # ZeroMQ's I/O thread, which receives every step, spread like the helper threads.
            self.ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self.status = "starting"
        self.busy_s = 0.0  # forward passes
        self.idle_s = 0.0  # waiting for the next step while steps are flowing
        self.steps = 0
        self.step_started: float | None = None  # monotonic: when the oldest running step began
        # Steps launched on the device whose outputs are not sent yet, oldest first (on the CPU
        # a step is done when launched; on a GPU the next one is launched behind it).
        self.launched: deque[LaunchedStep] = deque()
        self.launch_times: deque[float] = deque()  # monotonic, one per launched step
        self.control = ControlServer(self.ctx, stack.control_for("worker", rank), "worker",
                                     self._health).start()
        config = engine_args.create_engine_config()
        # A collective may wait for a rank as long as the engine waits for a step, and longer.
        self.worker = Worker(config, rank, stack.dist_init_addr,
                             group_timeout_s=2 * stack.step_timeout_s + stack.liveness_timeout_s)
        self.worker.init_device()
        self.worker.load_model()
        self.sock = make_socket(self.ctx, zmq.DEALER)
        self.sock.setsockopt_string(zmq.IDENTITY, f"worker-{rank}-{self.instance_id}")
        connect(self.sock, stack.worker_addr)
        self._stop = False
        self._heartbeat = threading.Thread(target=self._send_heartbeats, name="worker-heartbeat",
                                           daemon=True)
        self.status = "ok"

    def _health(self) -> tuple[str, dict]:
        details = {"rank": self.rank, "steps": self.steps, "busy_s": round(self.busy_s, 3),
                   "idle_s": round(self.idle_s, 3)}
        started = self.step_started
        if started is not None and time.monotonic() - started > self.stack.step_timeout_s:
            # Inside one step for longer than the engine waits for it: stuck, and the engine
            # has given up on it. The launcher restarts a process that stays "stuck".
            details["step_s"] = round(time.monotonic() - started, 1)
            return "stuck", details
        return self.status, details

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_stop", True))
        self._register()
        self._heartbeat.start()
        last_done = None  # when the last output went out with no step left running
        busy_since = 0.0  # when the running steps began (the first launched after none)
        # While nothing comes from the engine the registration is repeated: an engine that
        # restarted (or dropped this worker) learns of it without this process restarting.
        reregister_s = self.stack.liveness_timeout_s / 4
        quiet_since = time.monotonic()
        log.info("worker ready", rank=self.rank, engine=self.stack.worker_addr,
                 frozen_objects=freeze_startup_objects())
        group = self.worker.group
        try:
            if group is not None and not group.is_leader:
                self._serve_follower()
                return
            while not self._stop:
                if self.launched and self.launched[0].done():
                    self._send_oldest()
                    if not self.launched:
                        last_done = time.perf_counter()
                        self.busy_s += last_done - busy_since
                    continue
                if self.launched:
                    # A step runs on the device: look for the next one often, so that it is
                    # launched behind the running one and starts the moment that one ends.
                    if not self.sock.poll(0):
                        time.sleep(_RUNNING_POLL_S)
                        continue
                elif not self.sock.poll(int(min(reregister_s, _STOP_CHECK_S) * 1000)):
                    if time.monotonic() - quiet_since < reregister_s:
                        continue
                    quiet_since = time.monotonic()
                    last_done = None  # no steps flowing: not idle time between passes
                    if group is not None:
                        # Notices a rank that died while nothing ran (before registering,
                        # so that a broken group is not offered to the engine again).
                        group.ping()
                    self._register()
                    continue
                frame = self.sock.recv()
                now = time.perf_counter()
                if not self.launched:
                    busy_since = now
                    if last_done is not None:
                        self.idle_s += now - last_done
                self._handle(frame)
                if not self.launched:
                    last_done = time.perf_counter()
                    self.busy_s += last_done - busy_since
                quiet_since = time.monotonic()
            self._flush()  # what the device computed still goes out
        finally:
            if group is not None and group.is_leader and self._stop:
                try:
                    self.worker.stop_followers()
                except GroupBroken:
                    pass  # they are gone already
            self.close()

    def _serve_follower(self) -> None:
        """A rank other than 0: the leader relays every step; its own socket only registers."""
        registering = threading.Thread(target=self._keep_registered, name="worker-register",
                                       daemon=True)
        registering.start()
        try:
            self.worker.serve_follower(lambda: self._stop)
        finally:
            self._stop = True
            registering.join(timeout=self.stack.liveness_timeout_s)

    def _keep_registered(self) -> None:
        # The engine never answers a follower; repeating the registration keeps it listed
        # after an engine restart. The only user of self.sock while the follower serves
        # (joined before the socket is closed).
        spread_this_thread()
        while not self._stop:
            self._register()
            self._sleep_unless_stopped(self.stack.liveness_timeout_s / 4)

    def _sleep_unless_stopped(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, _STOP_CHECK_S))

    def _register(self) -> None:
        try:
            self.sock.send(encode(Register("worker", self.instance_id, self.rank)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the engine is away and the queue is full: the next try will do

    def _send_heartbeats(self) -> None:
        spread_this_thread()
        sock = make_socket(self.ctx, zmq.DEALER)
        connect(sock, self.stack.worker_addr)
        beat = encode(Register("worker", self.instance_id, self.rank, heartbeat=True))
        try:
            while not self._stop:
                sock.send(beat)
                self._sleep_unless_stopped(self.stack.liveness_timeout_s / 4)
        finally:
            sock.close(0)

    def _handle(self, frame: bytes) -> None:
        """A frame from the engine: a step is launched, behind the steps still running where
        it may be (Worker.can_launch_ahead), else once their outputs are out; anything else is
        answered once every launched step's output is out (replies go in order)."""
        try:
            msg = decode(frame, (ExecuteModelRequest, WorkerCall))
        except CodecError as e:
            log.warning("dropped a bad frame", error=str(e), size=len(frame))
            self._flush()
            self.sock.send(encode(ErrorResponse(None, 400, f"worker: bad frame: {e}")))
            return
        if not isinstance(msg, ExecuteModelRequest):
            self._flush()
            self.sock.send(self._answer_call(msg, frame))
            return
        if self.launched and not self.worker.can_launch_ahead(msg):
            self._flush()
        self.steps += 1
        self.launch_times.append(time.monotonic())
        self.step_started = self.launch_times[0]  # the launch itself may be what hangs
        try:
            self.worker.relay(msg, frame)
            self.launched.append(self.worker.launch(msg))
        except BaseException:
            self.launch_times.pop()
            self.step_started = self.launch_times[0] if self.launch_times else None
            self._flush()  # the steps launched before it were computed: their outputs go out
            raise

    def _send_oldest(self) -> None:
        """Finish the oldest launched step (waiting for the device) and send its output."""
        step = self.launched.popleft()
        self.launch_times.popleft()
        try:
            self.sock.send(encode(self.worker.finish(step)))
        finally:
            self.step_started = self.launch_times[0] if self.launch_times else None

    def _flush(self) -> None:
        while self.launched:
            self._send_oldest()

    def _answer_call(self, msg: WorkerCall, frame: bytes) -> bytes:
        try:
            if msg.method not in ("determine_num_available_blocks", "initialize_cache"):
                raise ValueError(f"unknown call {msg.method!r}")
            self.worker.relay(msg, frame)
            return encode(WorkerReply(msg.call_id, self.worker.call(msg.method, msg.args)))
        except GroupBroken:
            raise
        except Exception as e:
            if self.worker.group is not None:
                # The other ranks are inside the same call, perhaps in a collective this rank
                # will not enter now: the group is out of step and must be formed again.
                raise GroupBroken(f"{msg.method} failed on rank 0 of the group: "
                                  f"{type(e).__name__}: {e}") from e
            log.exception("worker call failed", method=msg.method)
            return encode(WorkerReply(msg.call_id, [], f"{type(e).__name__}: {e}"))

    def close(self) -> None:
        self._stop = True
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=self.stack.liveness_timeout_s)
        self.control.close()
        self.sock.close(0)
        self.ctx.term()
