"""Executor that drives worker processes over ZeroMQ.

The engine binds a ROUTER; workers connect (DEALER), register, and heartbeat. Each step is
encoded once and sent to every worker of the tensor-parallel group; rank 0 returns the
SamplerOutput.
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
    """A worker stopped answering (no output and no heartbeat within the liveness timeout)."""


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
        self.call_ids = itertools.count()
        self.in_flight: deque[int] = deque()  # step ids submitted, not collected
        self.last_request_bytes = 0
        self.wait_for_workers(register_timeout_s)

    # -- membership ----------------------------------------------------------------------------
    def wait_for_workers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_log = 0.0
        while len(self.workers) < self.world_size:
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
            self.last_seen[msg.instance_id] = time.monotonic()
            if msg.heartbeat or msg.service != "worker":
                return None
            current = self.workers.get(msg.rank)
            if current is not None and current != identity and self._alive(current):
                # A rank is taken until its worker stops beating: a stray or duplicate
                # registration must not steal the steps of a live worker.
                log.warning("registration for a taken rank ignored", rank=msg.rank,
                            instance=msg.instance_id)
                return None
            self.instance_of[identity] = msg.instance_id
            if current != identity:
                log.info("worker registered", rank=msg.rank, instance=msg.instance_id)
                self.workers[msg.rank] = identity
            return None
        if isinstance(msg, ErrorResponse):
            log.error("worker reported an error", message=msg.message)
            return None
        if expect is not None and isinstance(msg, expect):
            return identity, msg
        log.warning("unexpected message from a worker", type=type(msg).__name__)
        return None

    def _alive(self, identity: bytes) -> bool:
        seen = self.last_seen.get(self.instance_of.get(identity), 0.0)
        return time.monotonic() - seen < self.stack.liveness_timeout_s

    def _wait_for(self, expect, from_identity: bytes):
        timeout = self.stack.liveness_timeout_s
        while True:
            if not self.sock.poll(int(timeout * 1000)):
                instance = self.instance_of.get(from_identity)
                if time.monotonic() - self.last_seen.get(instance, 0) > timeout:
                    raise WorkerLost(f"worker {instance} sent no heartbeat for {timeout:.0f} s")
                continue
            got = self._recv_one(expect)
            if got is not None and got[0] == from_identity:
                return got[1]

    def _send_all(self, frame: bytes) -> None:
        for rank in range(self.world_size):
            try:
                self.sock.send_multipart([self.workers[rank], frame])
            except zmq.ZMQError as e:
                raise WorkerLost(f"worker rank {rank} unreachable: {e}") from None

    def _call(self, method: str, *args: int) -> list[int]:
        call_id = next(self.call_ids)
        self._send_all(encode(WorkerCall(call_id, method, list(args))))
        results = []
        for rank in range(self.world_size):
            reply = self._wait_for(WorkerReply, self.workers[rank])
            if reply.error:
                raise RuntimeError(f"worker rank {rank}: {method} failed: {reply.error}")
            results.append(reply.result)
        return results[0]

    # -- the executor interface ----------------------------------------------------------------
    def determine_num_available_blocks(self) -> tuple[int, int]:
        blocks = [self._call("determine_num_available_blocks")]
        return int(blocks[0][0]), int(blocks[0][1])

    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self._call("initialize_cache", num_device_blocks, num_cpu_blocks)

    def submit(self, request: ExecuteModelRequest) -> None:
        frame = encode(request)
        self.last_request_bytes = len(frame)
        self._send_all(frame)
        self.in_flight.append(request.step_id)

    def collect(self) -> SamplerOutput:
        step_id = self.in_flight.popleft()
        out = self._wait_for(SamplerOutput, self.workers[0])
        assert out.step_id == step_id, f"worker answered step {out.step_id}, expected {step_id}"
        return out

    def shutdown(self) -> None:
        self.sock.close(0)
