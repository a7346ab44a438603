"""The ZMQ stack as `pagoda serve` runs it (real processes, real sockets), one for the module:
the launcher's processes, sockets, arguments and logs; against the in-process engine: same
outputs, tokenizers scale, stops and aborts, bad frames survived; then the launcher's liveness
loop, a second stack refused, and stop (last: it ends the stack)."""
import asyncio
import os
import signal
import threading
import time

import pytest
import zmq

from ops.launcher import LaunchError, LocalStack
from pagoda import AsyncEngineClient, SamplingParams
from proto.codec import decode, encode
from proto.control import Register
from proto.requests import AbortRequest, ErrorResponse, GenerateRequest, HealthRequest
from shared.sockets import probe_health
from tests.test_launcher import alive, children_of

ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_num_seqs": 16}

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate 'good morning' into Spanish:",
    "A short list of fruits: apple,",
    "Q: What is the boiling point of water? A:",
    "import numpy as np\n",
    "The quick brown fox",
    "In 1492,",
    "My favourite book is",
    "Dear customer,",
    "The largest planet in the solar system is",
    "Here is a recipe for pancakes:",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("stack") / "run")
    launched = LocalStack(engine_args=ENGINE_ARGS, tokenizers=2, run_dir=run_dir, gateway=False)
    launched.start(timeout_s=300)
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def offline(llm):
    """The in-process engine to compare with: the session's default LLM (tests/conftest.py);
    greedy tokens do not depend on its larger max_num_seqs, and it is loaded once for every
    module that needs one."""
    return llm


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def cmdline_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")[:-1]



async def _collect(client, prompt, params, request_id=None):
    text, tokens, finish = "", [], None
    async for out in client.generate(prompt, params, request_id=request_id):
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
        finish = out.outputs[0].finish_reason
    return text, tokens, finish


def _run(stack, coro_fn):
    async def main():
        client = AsyncEngineClient(stack.stack_config)
        try:
            return await coro_fn(client)
        finally:
            client.close()
    return asyncio.run(main())


def _engine(stack) -> dict:
    return probe_health(stack.stack_config.engine_control, 5).details


def _wait_idle(stack, timeout_s=30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        details = _engine(stack)
        if (details["running"] == 0 and details["waiting"] == 0) or time.monotonic() > deadline:
            return details
        time.sleep(0.2)


# -- a running stack ---------------------------------------------------------------------------
def test_stack_starts_one_process_per_instance(stack):
    counts = {name: len(procs) for name, procs in stack.processes.items()}
    assert counts == {"tokenizer": 2, "engine": 1, "worker": 1, "detokenizer": 1}


def test_every_process_answers_its_probe_with_ok(stack):
    for member in stack.members:
        health = probe_health(member.control_addr, timeout_s=2)
        assert health is not None and health.status == "ok", member.name


def test_engine_sees_every_tokenizer_detokenizer_and_worker(stack):
    details = probe_health(stack.stack_config.engine_control, timeout_s=2).details
    assert (details["tokenizers"], details["detokenizers"], details["workers"]) == (2, 1, 1)


def test_a_request_completes_through_the_stack(stack):
    async def generate() -> tuple[str, bool]:
        client = AsyncEngineClient(stack.stack_config)
        text, finished = "", False
        try:
            async for out in client.generate("The capital of France is",
                                             SamplingParams(max_tokens=4, temperature=0)):
                text += out.outputs[0].text
                finished = out.finished
        finally:
            client.close()
        return text, finished

    text, finished = asyncio.run(asyncio.wait_for(generate(), 120))
    assert finished and text.strip()


def test_processes_use_ipc_sockets_in_the_run_directory(stack):
    engine = stack.processes["engine"][0]
    env = environ_of(engine.pid)
    assert env["PAGODA_RUN_DIR"] == stack.run_dir
    for key in ("PAGODA_REQUEST_INPUT", "PAGODA_TOKENIZER_INPUT", "PAGODA_ENGINE_INPUT",
                "PAGODA_WORKER_ADDR", "PAGODA_DETOKENIZER_ADDR", "PAGODA_ENGINE_CONTROL"):
        assert env[key].startswith(f"ipc://{stack.run_dir}/"), key
    assert "PAGODA_CONTROL_ADDR" not in env  # each process has its own control socket


def test_engine_args_reach_each_service_that_accepts_them(stack):
    tokenizer = cmdline_of(stack.processes["tokenizer"][1].pid)
    assert tokenizer[1:4] == ["-m", "pagoda", "tokenizer"]
    assert tokenizer[tokenizer.index("--max-num-seqs") + 1] == str(ENGINE_ARGS["max_num_seqs"])
    assert tokenizer[tokenizer.index("--instance") + 1] == "1"
    detokenizer = cmdline_of(stack.processes["detokenizer"][0].pid)
    # Every service takes the one engine command line (the detokenizer uses only the model's).
    assert detokenizer[detokenizer.index("--max-num-seqs") + 1] == str(ENGINE_ARGS["max_num_seqs"])


def test_each_process_logs_to_its_own_file(stack):
    logs = sorted(os.listdir(stack.log_dir))
    assert logs == ["detokenizer-0.log", "engine-0.log", "tokenizer-0.log", "tokenizer-1.log",
                    "worker-0.log"]
    with open(os.path.join(stack.log_dir, "engine-0.log")) as f:
        assert "engine ready" in f.read()


# -- against the in-process engine ------------------------------------------------------------
def test_16_concurrent_greedy_requests_match_the_in_process_engine(stack, offline):
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    got = _run(stack, lambda c: asyncio.gather(*(_collect(c, p, params) for p in PROMPTS)))
    for want, (text, tokens, finish) in zip(expected, got):
        assert tokens == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert finish == want.outputs[0].finish_reason
    print(f"\n{len(PROMPTS)} concurrent requests through the stack: "
          f"{sum(len(t) for _, t, _ in got)} tokens identical to the in-process engine")


def test_a_request_queued_past_the_request_timeout_waits_for_its_turn(stack):
    """The engine runs 16 sequences at most (ENGINE_ARGS): 16 long requests fill it, and 4
    more wait in its queue for far longer than the client's 1 s output timeout. They are
    accepted and get no output all that time, yet none fails: the engine runs steps."""
    timeout_s = 1.0
    long = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def first_output_after(client, prompt, params):
        start, first, tokens = time.monotonic(), None, 0
        async for out in client.generate(prompt, params):
            tokens += len(out.outputs[0].token_ids)
            first = first or (tokens and time.monotonic() - start)
        return first, tokens

    async def go():
        client = AsyncEngineClient(stack.stack_config, output_timeout_s=timeout_s,
                                   probe_interval_s=0.2)
        try:
            running = [asyncio.create_task(first_output_after(client, p, long))
                       for p in PROMPTS]
            while _engine(stack)["running"] < len(PROMPTS):
                await asyncio.sleep(0.05)
            queued = [asyncio.create_task(first_output_after(client, p, short))
                      for p in PROMPTS[:4]]
            return await asyncio.gather(*running), await asyncio.gather(*queued)
        finally:
            client.close()

    running, queued = asyncio.run(asyncio.wait_for(go(), 240))
    assert [tokens for _, tokens in running] == [160] * len(PROMPTS)
    assert [tokens for _, tokens in queued] == [4] * 4
    waits = [first for first, _ in queued]
    # Otherwise the engine was fast enough that nothing here waited past the timeout.
    assert min(waits) > 2 * timeout_s, waits
    print(f"\n4 queued requests got their first token after {min(waits):.1f}-"
          f"{max(waits):.1f} s with a {timeout_s:g} s request timeout")


def test_both_tokenizers_receive_work(stack):
    params = SamplingParams(temperature=0, max_tokens=2)
    _run(stack, lambda c: asyncio.gather(*(_collect(c, p, params) for p in PROMPTS)))
    handled = [probe_health(stack.stack_config.control_for("tokenizer", i), 5).details["handled"]
               for i in range(2)]
    assert all(h > 0 for h in handled), handled


def test_stop_strings_are_honoured(stack, offline):
    prompt = "1, 2, 3, 4,"
    full = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)[0].outputs[0].text
    stop = full.strip().split(",")[2].strip() if full.count(",") >= 3 else full[5:8]
    assert stop and stop in full
    text, _, finish = _run(stack, lambda c: _collect(
        c, prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop])))
    assert finish == "stop"
    assert text == full[:full.index(stop)]
    with_stop, _, _ = _run(stack, lambda c: _collect(c, prompt, SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)))
    assert with_stop == full[:full.index(stop) + len(stop)]


def test_an_abort_frees_the_requests_blocks(stack):
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def start_then_leave(client):
        gen = client.generate("Tell me a very long story.", params, request_id="to-abort")
        async for out in gen:
            if out.num_output_tokens and out.num_output_tokens >= 4:
                break  # leaving the stream aborts the request
        await gen.aclose()
        await asyncio.sleep(0.5)

    _run(stack, start_then_leave)
    details = _wait_idle(stack)
    assert details["running"] == 0
    assert details["kv_cache_usage"] == 0.0


def test_an_explicit_abort_ends_the_stream(stack):
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def abort_midway(client):
        async def consume():
            n = 0
            async for out in client.generate("Count to a thousand.", params, request_id="abort-me"):
                n += len(out.outputs[0].token_ids)
            return n
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(2.0)
        await client.abort("abort-me")
        await asyncio.sleep(1.0)
        task.cancel()
        return None

    _run(stack, abort_midway)
    details = _wait_idle(stack)
    assert details["running"] == 0 and details["kv_cache_usage"] == 0.0


BAD_FRAMES = [b"", b"\x00", b"garbage \xff\xfe", b"\x93\x01\x01", encode(HealthRequest())[:-1] + b"\xc1",
              encode(AbortRequest(["x"], "y"))[:3], b"\x92\x63\x01",  # unknown tag
              b"\x92\x01\x63",  # GenerateRequest with an unknown version
              encode(Register("worker", "fake", 0))]  # right type on the wrong socket


def test_malformed_frames_to_every_socket_are_dropped_and_service_goes_on(stack):
    cfg = stack.stack_config
    ctx = zmq.Context()
    try:
        # Frames each service's bound or connected sockets can receive from outside.
        push_targets = [cfg.request_input, cfg.engine_input]
        for addr in push_targets:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            for frame in BAD_FRAMES + [b"\x00" * 70_000_000]:
                sock.send(frame)
            sock.close()
        for addr in (cfg.worker_addr, cfg.detokenizer_addr):  # the engine's ROUTERs
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            for frame in BAD_FRAMES:
                sock.send(frame)
            sock.close()
        controls = [cfg.engine_control, cfg.control_for("worker", 0), cfg.control_for("detokenizer", 0),
                    cfg.control_for("tokenizer", 0), cfg.control_for("tokenizer", 1)]
        for addr in controls:
            for frame in BAD_FRAMES[:4]:
                sock = ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVTIMEO, 5000)
                sock.connect(addr)
                sock.send(frame)
                reply = decode(sock.recv())  # answered with an error, not silence or a crash
                assert isinstance(reply, ErrorResponse), (addr, frame, reply)
                sock.close()
        # A GenerateRequest whose return address is junk must not hurt anyone either.
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(cfg.request_input)
        sock.send(encode(GenerateRequest("junk-return", "not-an-address", "hi",
                                         SamplingParams(max_tokens=2), 0.0)))
        sock.close()
    finally:
        ctx.destroy(linger=1000)
    time.sleep(1.0)
    for addr in controls:
        assert probe_health(addr, 5).status == "ok", addr
    text, tokens, _ = _run(stack, lambda c: _collect(c, "The capital of France is",
                                                     SamplingParams(temperature=0, max_tokens=8)))
    assert len(tokens) == 8 and text


def test_bytes_per_decode_step_do_not_grow_with_sequence_length(offline):
    """Measured on the engine's real scheduler output, encoded as the worker receives it."""
    engine = offline.llm_engine
    sizes = {}
    for length in (100, 1000):
        engine.add_request(f"len-{length:05d}", None, SamplingParams(max_tokens=6, ignore_eos=True),
                           prompt_token_ids=[100 + (i % 1000) for i in range(length)])
        steps = []
        while engine.has_unfinished_requests():
            request, sched = engine.schedule_step()
            if request is None:
                break
            steps.append((request, len(encode(request))))
            engine.process_model_outputs(sched, engine.executor.execute_model(request))
        decode_sizes = [size for request, size in steps
                        if not any(m.is_prompt for m in request.seq_group_metadata_list)]
        # The first decode step may carry a new block; the steady ones must all be equal.
        sizes[length] = decode_sizes[1:]
    assert len(set(sizes[100])) == 1 and sizes[100] == sizes[1000][:len(sizes[100])], sizes
    print(f"\nbytes per decode step: {sizes[100][0]} at length 100, {sizes[1000][0]} at length 1000")


# -- the launcher's liveness loop and stop (last: stop ends the module's stack) ------------
def test_liveness_loop_restarts_a_process_that_exited(stack):
    old = stack.kill("detokenizer", 0, signal.SIGKILL)
    [detokenizer] = [m for m in stack.members if m.name == "detokenizer-0"]
    stop = threading.Event()

    def stop_when_back():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not stop.is_set():
            if stack.processes["detokenizer"][0] is not old and detokenizer.healthy:
                break
            time.sleep(0.5)
        stop.set()

    watcher = threading.Thread(target=stop_when_back)
    watcher.start()
    stack.supervise(stop, check_every_s=0.5)  # in this thread: it spawns the new process
    watcher.join()
    new = stack.processes["detokenizer"][0]
    assert new.pid != old.pid and new.poll() is None
    health = probe_health(stack.stack_config.control_for("detokenizer", 0), timeout_s=2)
    assert health is not None and health.status == "ok"


def test_a_second_stack_in_the_same_run_directory_is_refused(stack):
    second = LocalStack(run_dir=stack.run_dir, gateway=False)
    with pytest.raises(LaunchError, match="already runs"):
        second.start(timeout_s=30)
    assert second.processes == {}
    assert probe_health(stack.stack_config.engine_control, timeout_s=2).status == "ok"
    assert os.path.exists(stack.stack_config.request_input[len("ipc://"):])


def test_stop_leaves_no_process_and_no_socket(stack):
    pids = [p.pid for procs in stack.processes.values() for p in procs]
    grandchildren = [c for pid in pids for c in children_of(pid)]
    stack.stop()
    assert not [pid for pid in pids + grandchildren if alive(pid)]
    assert not os.path.exists(stack.run_dir)
