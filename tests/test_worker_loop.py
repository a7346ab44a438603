"""The worker process's loop (services/worker/main.py) when a launched step is still running,
as on a GPU: the step behind it is launched before the running one is finished, outputs go
back in step order, and a setup call waits for the running steps' outputs. The loop runs
in-process over real ZeroMQ sockets on a tiny model; a GPU's asynchrony is played by a stand-in
around the real Worker whose launched steps report "not done" (and whose `finish` waits) until
the test releases them, since on the CPU a step is done when `launch` returns."""
import tempfile
import threading
import time

import pytest
import zmq

from pagoda import SamplingParams
from proto.codec import decode, encode
from proto.control import Register, WorkerCall, WorkerReply
from proto.messages import SamplerOutput
from services.engine.executor.uniproc import UniProcExecutor
from services.engine.llm_engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.stack_config import StackConfig
from tests.helpers import save_random_model, tiny_llama_config

PROMPT = [5, 17, 200, 3, 9, 41]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    from ops.bench.gpu_check.random_models import word_tokenizer
    folder = tmp_path_factory.mktemp("tiny-loop")
    config = tiny_llama_config(num_hidden_layers=2)
    save_random_model(config, folder)
    word_tokenizer(config.vocab_size).save_pretrained(folder)
    return str(folder)


class HeldStep:
    """A launched step that, like one still on a GPU, is not done until released."""

    def __init__(self, step, released: threading.Event):
        self.step = step
        self.released = released

    def done(self) -> bool:
        return self.released.is_set()


class HeldDevice:
    """The real Worker, its launched steps held (stand-in for a GPU's asynchrony)."""

    def __init__(self, worker):
        self.worker = worker
        self.group = None
        self.released = threading.Event()
        self.launches: list[tuple[int, int]] = []  # (step id, unfinished steps at its launch)
        self.unfinished = 0

    def relay(self, *args) -> None:
        pass

    def can_launch_ahead(self, request) -> bool:
        return self.worker.can_launch_ahead(request)

    def launch(self, request):
        self.launches.append((request.step_id, self.unfinished))
        self.unfinished += 1
        return HeldStep(self.worker.launch(request), self.released)

    def finish(self, held: HeldStep) -> SamplerOutput:
        assert held.released.wait(30), "a held step was never released"
        self.unfinished -= 1
        return self.worker.finish(held.step)

    def call(self, method: str, args: list[int]) -> list[int]:
        return self.worker.call(method, args)


@pytest.fixture
def loop(model_folder, monkeypatch):
    """(engine socket, worker identity, HeldDevice, an LLMEngine that schedules the steps)."""
    from services.worker import main as worker_main
    from services.worker.main import WorkerService
    # The loop runs in a thread here; signal handlers belong to the main thread (the test
    # stops the loop with the flag SIGTERM would set).
    monkeypatch.setattr(worker_main.signal, "signal", lambda *args: None)
    run_dir = tempfile.mkdtemp(prefix="ploop-", dir="/tmp")
    stack = StackConfig(run_dir=run_dir, liveness_timeout_s=60)
    args = EngineArgs(model=model_folder, device="cpu", num_gpu_blocks_override=64,
                      max_num_seqs=4, max_model_len=128)
    ctx = zmq.Context()
    engine_sock = ctx.socket(zmq.ROUTER)
    engine_sock.bind(stack.worker_addr)
    service = WorkerService(args, stack)
    service.worker.initialize_cache(64, 0)
    device = service.worker = HeldDevice(service.worker)
    thread = threading.Thread(target=service.serve, daemon=True)
    thread.start()
    identity = None
    while identity is None:  # the main socket's registration (the heartbeats have their own)
        assert engine_sock.poll(30_000)
        ident, frame = engine_sock.recv_multipart()
        msg = decode(frame)
        if isinstance(msg, Register) and not msg.heartbeat:
            identity = ident
    engine = LLMEngine(args.create_engine_config(), UniProcExecutor)
    yield engine_sock, identity, device, engine
    device.released.set()
    service._stop = True
    thread.join(10)
    engine_sock.close(0)
    ctx.term()


def replies(sock, count: int, timeout_s: float = 30) -> list:
    """The next `count` step outputs and call replies from the worker, in arrival order."""
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < count:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), out
        _, frame = sock.recv_multipart()
        msg = decode(frame)
        if not isinstance(msg, Register):
            out.append(msg)
    return out


def test_a_step_arriving_while_one_runs_is_launched_behind_it_and_outputs_keep_their_order(
        loop):
    sock, identity, device, engine = loop
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("held", None, params, prompt_token_ids=PROMPT)
    in_flight = []
    for _ in range(2):  # the prompt, and its first decode scheduled behind it
        request, sched = engine.schedule_step()
        sock.send_multipart([identity, encode(request)])
        in_flight.append((request.step_id, sched))
    deadline = time.monotonic() + 30
    while len(device.launches) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Both launched, the second while the first had not finished; nothing has come back yet.
    assert device.launches == [(in_flight[0][0], 0), (in_flight[1][0], 1)]
    assert not [m for m in replies_now(sock)]
    device.released.set()
    outs = replies(sock, 2)
    assert [o.step_id for o in outs] == [step_id for step_id, _ in in_flight]
    for (_, sched), out in zip(in_flight, outs):
        engine.process_model_outputs(sched, out)
    # The rest of the request through the worker, one step at a time; its tokens are those of
    # the same engine run in process.
    held = engine.groups["held"]
    while engine.has_unfinished_requests():
        request, sched = engine.schedule_step()
        sock.send_multipart([identity, encode(request)])
        engine.process_model_outputs(sched, replies(sock, 1)[0])
    want = engine.add_request("again", None, params, prompt_token_ids=PROMPT)
    while engine.has_unfinished_requests():
        engine.step()
    assert held.first_seq.output_token_ids == want.first_seq.output_token_ids
    assert len(want.first_seq.output_token_ids) == 6


def test_a_call_waits_for_the_running_steps_outputs(loop):
    sock, identity, device, engine = loop
    engine.add_request("call", None, SamplingParams(temperature=0, max_tokens=3),
                       prompt_token_ids=PROMPT)
    request, sched = engine.schedule_step()
    sock.send_multipart([identity, encode(request)])
    sock.send_multipart([identity, encode(WorkerCall(7, "determine_num_available_blocks", []))])
    time.sleep(0.3)
    assert not replies_now(sock)  # the step is held, and the call's reply is behind it
    device.released.set()
    step_out, reply = replies(sock, 2)
    assert isinstance(step_out, SamplerOutput) and step_out.step_id == request.step_id
    assert isinstance(reply, WorkerReply) and reply.call_id == 7 and not reply.error


def replies_now(sock) -> list:
    """Whatever the worker has sent already, registrations aside."""
    out = []
    while sock.poll(0):
        _, frame = sock.recv_multipart()
        msg = decode(frame)
        if not isinstance(msg, Register):
            out.append(msg)
    return out

