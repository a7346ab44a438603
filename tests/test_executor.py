"""ZmqExecutor's watchdogs and worker membership, over real ZeroMQ sockets. The worker here is a
thread speaking the worker's side of the protocol (register, heartbeat, answer setup calls) that
never answers a step: a worker stuck inside a step while its heartbeat thread lives, which a real
worker process cannot be made to do on purpose."""
import tempfile
import threading
import time

import pytest
import zmq

from proto.codec import decode, encode
from proto.control import Register, WorkerCall, WorkerReply
from proto.messages import ExecuteModelRequest
from services.engine.executor.zmq_executor import WorkerLost, ZmqExecutor
from shared.engine_args import EngineArgs
from shared.stack_config import StackConfig

LIVENESS_S = 2.0


class StuckWorker(threading.Thread):
    """Registers for rank 0, beats every 0.2 s, answers setup calls, swallows steps."""

    def __init__(self, addr: str, instance: str = "stuck-worker"):
        super().__init__(daemon=True)
        self.addr = addr
        self.instance = instance
        self.stop = threading.Event()
        self.steps = 0

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(self.addr)
        sock.send(encode(Register("worker", self.instance, 0)))
        beat = encode(Register("worker", self.instance, 0, heartbeat=True))
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


def test_a_new_worker_takes_a_silent_workers_rank_only_once_the_loss_is_raised(executor):
    """A restarted worker may register after its predecessor's heartbeats have run out but
    before the engine has checked them: it must not take the rank silently, or the engine
    would set a fresh KV cache up under sequences that still hold blocks of the dead one."""
    executor, old = executor
    old.stop.set()
    old.join(5)
    executor.receive()  # its last heartbeats
    time.sleep(LIVENESS_S + 0.3)  # the old worker is past its liveness, not yet declared lost
    new = StuckWorker(executor.stack.worker_addr, "new-worker")
    new.start()
    try:
        deadline = time.monotonic() + 10
        while not registered(executor, "new-worker") and time.monotonic() < deadline:
            executor.receive()
            time.sleep(0.05)
        assert registered(executor, "new-worker"), "the new worker never registered"
        assert executor.worker_instances() == ("stuck-worker",)
        assert rank_candidate(executor) == "new-worker"
        assert executor.ready  # nothing has changed hands: no new cache set up behind the engine
        with pytest.raises(WorkerLost, match="no heartbeat"):
            executor.check_liveness()
        assert executor.drop_lost_workers() == [0]
        assert executor.worker_instances() == ("new-worker",)
        assert not executor.ready  # its KV cache is set up next
        executor.initialize_cache(*executor.determine_num_available_blocks())
        assert executor.ready
    finally:
        new.stop.set()
        new.join(5)


def test_before_its_cache_is_set_up_a_silent_workers_rank_goes_to_a_new_worker_at_once():
    """With no KV cache set up there is nothing to recompute, and in a tensor-parallel group
    with a rank still empty nothing checks liveness: there a registration takes a silent
    worker's rank at once."""
    stack = StackConfig(run_dir=tempfile.mkdtemp(prefix="pexec-", dir="/tmp"),
                        liveness_timeout_s=LIVENESS_S)
    config = EngineArgs(kv_cache_space_gib=0.01).create_engine_config()
    ctx = zmq.Context()
    old = StuckWorker(stack.worker_addr)
    old.start()
    executor = ZmqExecutor(config, stack, ctx, register_timeout_s=30)
    new = StuckWorker(stack.worker_addr, "new-worker")
    try:
        assert executor.worker_instances() == ("stuck-worker",) and not executor.ready
        old.stop.set()
        old.join(5)
        executor.receive()
        time.sleep(LIVENESS_S + 0.3)
        new.start()
        deadline = time.monotonic() + 10
        while not registered(executor, "new-worker") and time.monotonic() < deadline:
            executor.receive()
            time.sleep(0.05)
        assert executor.worker_instances() == ("new-worker",)
        executor.initialize_cache(*executor.determine_num_available_blocks())
        assert executor.ready
    finally:
        for worker in (old, new):
            worker.stop.set()
            if worker.is_alive():
                worker.join(5)
        executor.shutdown()
        ctx.destroy(linger=0)


def registered(executor, instance: str) -> bool:
    return instance in executor.worker_instances() or rank_candidate(executor) == instance


def rank_candidate(executor):
    identity = executor.candidates.get(0)
    return executor.instance_of.get(identity) if identity is not None else None
