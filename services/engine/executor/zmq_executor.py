"""Executor that drives worker processes over ZeroMQ.

The engine binds a ROUTER; workers connect (DEALER), register, and heartbeat. Each step is
encoded once and sent once, to rank 0 of the tensor-parallel group, which relays it to the
other ranks over torch.distributed and returns the SamplerOutput; the other ranks only
register and heartbeat, so that the engine knows the whole group is there. A lost rank loses
the whole group (its processes exit and form it again), so every rank is dropped with it.

A worker that goes silent for the liveness timeout (or whose connection is gone) raises
`WorkerLost`; the engine then calls `drop_lost_workers`, waits until `has_all_workers()` again
(a restarted worker registers for the rank), initializes the new worker's KV cache and goes on.
`receive` / `take_output` let the engine wait for a step while it keeps serving its other
sockets; `collect` is the blocking form.
"""
import itertools
import time
from collections import deque

import zmq

from proto.codec import CodecError, decode, encode
from proto.control import Register, WorkerCall, WorkerReply
from proto.messages import ExecuteModelRequest, SamplerOutput
from proto.requests import ErrorResponse
from shared.config import PagodaConfig
from shared.logging import get_logger
from shared.sockets import bind, make_socket
from shared.stack_config import StackConfig
from services.engine.executor.base import Executor

log = get_logger("executor")


class WorkerLost(RuntimeError):
    """A worker stopped answering (no output and no heartbeat within the liveness timeout, or
    a step that has not come back within the step timeout), or its connection is gone. The
    engine catches it and waits for a worker to take the rank."""


class WorkerCallError(RuntimeError):
    """A worker answered a setup call with an error (e.g. out of memory for the KV cache)."""


class ZmqExecutor(Executor):
    def __init__(self, config: PagodaConfig, stack: StackConfig, ctx: zmq.Context,
                 register_timeout_s: float = 600.0):
        super().__init__(config)
        self.stack = stack
        self.world_size = config.parallel_config.tensor_parallel_size
        self.sock = make_socket(ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bind(self.sock, stack.worker_addr)
        self.workers: dict[int, bytes] = {}  # rank -> routing identity
        self.instance_of: dict[bytes, str] = {}  # routing identity -> worker instance
        self.last_seen: dict[str, float] = {}  # worker instance -> last frame or heartbeat
        # A registration for a rank that a worker holds: it takes the rank when that worker is
        # declared lost (a restarted worker often registers before the engine has noticed that
        # its predecessor died).
        self.candidates: dict[int, bytes] = {}
        # Worker processes whose setup failed too often: their registrations are ignored, and
        # a rank waits for a new process.
        self.refused_instances: set[str] = set()
        self.call_ids = itertools.count()
        self.in_flight: deque[int] = deque()  # step ids submitted, not collected
        # When the workers last moved on: the oldest step in flight was sent, or an output came.
        self.last_progress = time.monotonic()
        self.outputs: deque[SamplerOutput] = deque()  # arrived, in step order, not collected
        self.last_request_bytes = 0
        # Steps go out only once every rank has a worker whose KV cache is initialized.
        self.cache_ready = False
        self.wait_for_workers(register_timeout_s)

    @property
    def ready(self) -> bool:
        return self.cache_ready and self.has_all_workers()

    def has_all_workers(self) -> bool:
        return len(self.workers) == self.world_size

    # -- membership ----------------------------------------------------------------------------
    def wait_for_workers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_log = 0.0
        while not self.has_all_workers():
            if time.monotonic() > deadline:
                raise WorkerLost(f"{len(self.workers)} of {self.world_size} workers registered "
                                 f"within {timeout_s:.0f} s at {self.stack.worker_addr}")
            if time.monotonic() - last_log > 5:
                log.info("waiting for workers", registered=len(self.workers),
                         needed=self.world_size, addr=self.stack.worker_addr)
                last_log = time.monotonic()
            if self.sock.poll(500):
                self._recv_one(expect=None)

    def _recv_one(self, expect):
        """Receive one frame; handle registrations/heartbeats; return a message of `expect`."""
        frames = self.sock.recv_multipart()
        identity, frame = frames[0], frames[-1]  # a well-formed peer sends one frame
        if identity in self.instance_of:
            self.last_seen[self.instance_of[identity]] = time.monotonic()
        try:
            msg = decode(frame)
        except CodecError as e:
            log.warning("dropped a bad frame from a worker", error=str(e))
            return None
        if isinstance(msg, Register):
            self._register(msg, identity)
            return None
        if isinstance(msg, ErrorResponse):
            log.error("worker reported an error", message=msg.message)
            return None
        if expect is not None and isinstance(msg, expect):
            return identity, msg
        log.warning("unexpected message from a worker", type=type(msg).__name__)
        return None

    def _register(self, msg: Register, identity: bytes) -> None:
        if msg.service != "worker" or not 0 <= msg.rank < self.world_size:
            return
        self.last_seen[msg.instance_id] = time.monotonic()
        if msg.heartbeat:
            return
        if msg.instance_id in self.refused_instances:
            return
        current = self.workers.get(msg.rank)
        if current == identity:
            return  # a worker repeats its registration while it has nothing to do
        self.instance_of[identity] = msg.instance_id
        if current is not None and (self.cache_ready or self._alive(current)):
            # While a cache is set up, a rank changes hands only in drop_lost_workers, after
            # a WorkerLost: a stray or duplicate registration must not steal the steps of a
            # live worker, and a dead worker's steps in flight and KV cache must be given up
            # (the engine recomputes its requests) before a new one starts from an empty
            # cache; check_liveness notices the dead one. With no cache set up (start-up, or
            # after a drop, which recomputed) a silent worker's rank is taken at once: in a
            # tensor-parallel group with a rank still empty, nothing checks liveness.
            if self.candidates.get(msg.rank) != identity:
                log.warning("registration for a taken rank kept as a candidate", rank=msg.rank,
                            instance=msg.instance_id)
            self.candidates[msg.rank] = identity
            return
        log.info("worker registered", rank=msg.rank, instance=msg.instance_id)
        self.workers[msg.rank] = identity
        self.candidates.pop(msg.rank, None)
        self.cache_ready = False  # a new worker has no KV cache yet

    def _alive(self, identity: bytes) -> bool:
        seen = self.last_seen.get(self.instance_of.get(identity), 0.0)
        return time.monotonic() - seen < self.stack.liveness_timeout_s

    def refuse_workers(self) -> list[str]:
        """Forget the registered workers and ignore those processes from now on (their setup
        keeps failing); returns their instance ids."""
        instances = [self.instance_of.get(identity, "?") for identity in self.workers.values()]
        self.refused_instances.update(instances)
        self.workers.clear()
        self.candidates.clear()
        self.cache_ready = False
        return instances

    def worker_instances(self) -> tuple[str, ...]:
        return tuple(self.instance_of.get(self.workers[r], "?") for r in sorted(self.workers))

    def check_liveness(self) -> None:
        """Raises WorkerLost when a registered worker has been silent for the liveness timeout."""
        for rank, identity in self.workers.items():
            if not self._alive(identity):
                raise WorkerLost(f"worker rank {rank} ({self.instance_of.get(identity)}) sent "
                                 f"no heartbeat for {self.stack.liveness_timeout_s:.0f} s")

    def check_progress(self, step_timeout_s: float) -> None:
        """Raises WorkerLost when a step has been in flight for `step_timeout_s` without an
        output coming back: a worker that still heartbeats but is stuck (liveness is not
        progress)."""
        if len(self.outputs) < len(self.in_flight):
            stuck_s = time.monotonic() - self.last_progress
            if stuck_s > step_timeout_s:
                raise WorkerLost(f"step {self.in_flight[len(self.outputs)]} has not come back "
                                 f"for {stuck_s:.0f} s (step timeout {step_timeout_s:g} s)")

    def drop_lost_workers(self) -> list[int]:
        """After a WorkerLost: forget the workers that are gone (their ranks wait for a new
        registration, or take a candidate that is alive) and every step in flight. Returns
        the ranks that were dropped."""
        lost = [rank for rank, identity in self.workers.items() if not self._alive(identity)]
        if not lost or self.world_size > 1:
            # Unreachable but still beating (its connection broke): it cannot be used either.
            # In a tensor-parallel group, one lost rank breaks the group for all.
            lost = list(self.workers)
        for rank in lost:
            self.workers.pop(rank)
            candidate = self.candidates.pop(rank, None)
            if candidate is not None and self._alive(candidate):
                log.info("worker registered", rank=rank, instance=self.instance_of.get(candidate))
                self.workers[rank] = candidate
        self.in_flight.clear()
        self.outputs.clear()
        self.cache_ready = False
        return lost

    def _wait_for(self, expect, from_identity: bytes):
        timeout = self.stack.liveness_timeout_s
        while True:
            if not self.sock.poll(int(min(timeout, 1.0) * 1000)):
                if not self._alive(from_identity):
                    instance = self.instance_of.get(from_identity)
                    raise WorkerLost(f"worker {instance} sent no heartbeat for {timeout:.0f} s")
                continue
            got = self._recv_one(expect)
            if got is not None and got[0] == from_identity:
                return got[1]

    def _send_to_leader(self, frame: bytes) -> None:
        """To rank 0, which relays to the rest of its group; every rank must be registered."""
        for rank in range(self.world_size):
            if rank not in self.workers:
                raise WorkerLost(f"no worker holds rank {rank}")
        try:
            self.sock.send_multipart([self.workers[0], frame])
        except zmq.ZMQError as e:
            raise WorkerLost(f"worker rank 0 unreachable: {e}") from None

    def _call(self, method: str, *args: int) -> list[int]:
        call_id = next(self.call_ids)
        self._send_to_leader(encode(WorkerCall(call_id, method, list(args))))
        while True:
            reply = self._wait_for(WorkerReply, self.workers[0])
            if reply.call_id == call_id:
                break  # else the answer to a call of an engine that is gone
        if reply.error:
            raise WorkerCallError(f"worker rank 0: {method} failed: {reply.error}")
        return reply.result

    # -- the executor interface ----------------------------------------------------------------
    def determine_num_available_blocks(self) -> tuple[int, int]:
        # Rank 0 answers with the fewest over its group's ranks.
        num_device, num_cpu = self._call("determine_num_available_blocks")
        return int(num_device), int(num_cpu)

    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self._call("initialize_cache", num_device_blocks, num_cpu_blocks)
        self.cache_ready = True

    def submit(self, request: ExecuteModelRequest) -> None:
        frame = encode(request)
        self.last_request_bytes = len(frame)
        self._send_to_leader(frame)
        if not self.in_flight:
            self.last_progress = time.monotonic()
        self.in_flight.append(request.step_id)

    def receive(self) -> None:
        """Take in every frame waiting on the socket (outputs, registrations, heartbeats)
        without blocking."""
        while self.sock.poll(0):
            got = self._recv_one(SamplerOutput)
            if got is None:
                continue
            identity, out = got
            if identity != self.workers.get(0):
                continue  # from a worker that was dropped
            waiting = len(self.outputs)  # outputs come in step order
            expected = self.in_flight[waiting] if waiting < len(self.in_flight) else None
            if out.step_id != expected:
                log.warning("dropped the output of a step not in flight", step_id=out.step_id)
                continue
            self.outputs.append(out)
            self.last_progress = time.monotonic()

    def take_output(self) -> SamplerOutput | None:
        """The oldest step's output if it has arrived (call `receive` first), else None."""
        if not self.outputs:
            return None
        self.in_flight.popleft()
        return self.outputs.popleft()

    def collect(self) -> SamplerOutput:
        assert self.in_flight, "collect() with no step in flight"
        while True:
            self.receive()
            out = self.take_output()
            if out is not None:
                return out
            self.check_liveness()
            self.sock.poll(int(min(self.stack.liveness_timeout_s, 1.0) * 1000))

    def shutdown(self) -> None:
        self.sock.close(0)
