"""ZmqExecutor's watchdogs, over real ZeroMQ sockets. The worker here is a thread speaking the
worker's side of the protocol (register, heartbeat, answer setup calls) that never answers a
step: a worker stuck inside a step while its heartbeat thread lives, which a real worker
process cannot be made to do on purpose."""
import tempfile
import threading
import time

import pytest
import zmq

from proto.codec import decode, encode
from proto.control import Register, WorkerCall, WorkerReply
from proto.messages import ExecuteModelRequest
from services.engine.executor.zmq_executor import WorkerLost, ZmqExecutor
from shared.config import EngineArgs
from shared.stack_config import StackConfig

LIVENESS_S = 2.0


class StuckWorker(threading.Thread):
    """Registers for rank 0, beats every 0.2 s, answers setup calls, swallows steps."""

    def __init__(self, addr: str):
        super().__init__(daemon=True)
        self.addr = addr
        self.stop = threading.Event()
        self.steps = 0

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(self.addr)
        sock.send(encode(Register("worker", "stuck-worker", 0)))
        beat = encode(Register("worker", "stuck-worker", 0, heartbeat=True))
        while not self.stop.is_set():
            sock.send(beat)
            if sock.poll(200):
                msg = decode(sock.recv())
                if isinstance(msg, WorkerCall):
                    result = [64, 0] if msg.method == "determine_num_available_blocks" else []
                    sock.send(encode(WorkerReply(msg.call_id, result)))
                elif isinstance(msg, ExecuteModelRequest):
                    self.steps += 1  # and never answered
        sock.close(0)
        ctx.term()


@pytest.fixture
def executor():
    run_dir = tempfile.mkdtemp(prefix="pexec-", dir="/tmp")
    stack = StackConfig(run_dir=run_dir, liveness_timeout_s=LIVENESS_S)
    config = EngineArgs(kv_cache_space_gib=0.01).create_engine_config()
    ctx = zmq.Context()
    worker = StuckWorker(stack.worker_addr)
    worker.start()
    executor = ZmqExecutor(config, stack, ctx, register_timeout_s=30)
    executor.initialize_cache(*executor.determine_num_available_blocks())
    yield executor, worker
    worker.stop.set()
    worker.join(5)
    executor.shutdown()
    ctx.destroy(linger=0)


def test_a_step_that_never_returns_is_a_lost_worker_though_it_still_heartbeats(executor):
    executor, worker = executor
    step_timeout_s = 1.5
    executor.submit(ExecuteModelRequest(step_id=1, seq_group_metadata_list=[]))
    sent = time.monotonic()
    raised_after = None
    while time.monotonic() - sent < step_timeout_s + 3:
        executor.receive()
        executor.check_liveness()  # the heartbeats keep it alive the whole time
        try:
            executor.check_progress(step_timeout_s)
        except WorkerLost as e:
            raised_after = time.monotonic() - sent
            assert "has not come back" in str(e)
            break
        time.sleep(0.05)
    assert worker.steps == 1
    assert raised_after is not None, "a stuck step was not noticed"
    assert step_timeout_s <= raised_after < step_timeout_s + 1.0
    # Dropped like a dead worker: its rank waits for a new registration.
    assert executor.drop_lost_workers() == [0]
    assert not executor.ready


def test_no_step_in_flight_is_never_stuck(executor):
    executor, _ = executor
    time.sleep(1.0)
    executor.receive()
    executor.check_progress(0.5)  # nothing in flight: idle is not stuck
    executor.check_liveness()
