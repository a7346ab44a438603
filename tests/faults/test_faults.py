"""Process faults on the real stack: a worker, tokenizer or detokenizer is killed with SIGKILL
while requests stream, and comes back by the launcher's supervision (`LocalStack.supervise`, in
a thread). Engine and gateway deaths and stuck processes: `test_restarts.py`.

- every request completes, its text and tokens equal a fault-free pass of the same greedy
  requests through the same stack, and the engine generated exactly as many tokens as the
  clients received (nothing ran twice, nothing was emitted twice);
- fuzzing: bad frames to every socket and bad bodies to every HTTP route kill nothing and get
  no 500.
"""
import asyncio
import json
import os
import random
import signal
import time

import httpx
import msgpack
import zmq

from proto.codec import MAX_FRAME_BYTES, decode, encode
from proto.control import Register, WorkerCall, WorkerReply
from proto.messages import ExecuteModelRequest, SamplerOutput
from proto.requests import (AbortRequest, EngineRequest, ErrorResponse, FinishRequest,
                            GenerateRequest, HealthRequest, HealthResponse, RequestAccepted,
                            RequestTextDelta, RequestTokenDelta, SequenceTextDelta,
                            SequenceTokenDelta, TextDeltas, TokenDeltas, Usage)
from shared.model_source import DEFAULT_MODEL_NAME
from shared.sampling_params import SamplingParams
from tests.faults.stack_faults import (MAX_TOKENS, NUM_REQUESTS, assert_same_as_baseline,
                                       faulted_run, mid_stream, wait_until)

# -- fuzzing ---------------------------------------------------------------------------------------

def valid_frames() -> list[bytes]:
    """One valid frame of every message type, with values a real peer would not send."""
    params = SamplingParams(max_tokens=1)
    messages = [
        GenerateRequest("fuzz-g", "ipc:///nonexistent/fuzz.sock", "hi", params, 0.0),
        GenerateRequest("fuzz-e", "not-an-address", [], params, 0.0),
        EngineRequest("fuzz-x", "ipc:///nonexistent/fuzz.sock", None, [10**6, -1], params, [], 0.0),
        EngineRequest("fuzz-y", "tcp://999.1.1.1:1", None, [], params, [], 0.0),
        AbortRequest(["no-such-request"] * 3, "fuzz"), FinishRequest(["nope"], "fuzz"),
        TokenDeltas(7, [RequestTokenDelta("nope", "nowhere", 3, [SequenceTokenDelta(0, [1])])]),
        TextDeltas([RequestTextDelta("nope", [SequenceTextDelta(0, "x", [1])], Usage(1, 1))]),
        ErrorResponse(None, 500, "fuzz"), HealthRequest(), HealthResponse("fuzz", "ok"),
        RequestAccepted(["nope"]), ExecuteModelRequest(step_id=123456, seq_group_metadata_list=[]),
        SamplerOutput(step_id=123456, seq_ids=[1], token_ids=[2], logprobs=[0.0]),
        Register("worker", "fuzz-worker", 7), Register("worker", "fuzz-worker", 0, heartbeat=True),
        Register("detokenizer", "fuzz-detok", heartbeat=True), Register("gateway", "fuzz"),
        WorkerCall(1, "initialize_cache", [1, 1]), WorkerReply(99, [1, 2]),
    ]
    return [encode(m) for m in messages]


def random_frame(rng: random.Random, valid: list[bytes]) -> bytes:
    kind = rng.randrange(7)
    base = rng.choice(valid)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 300))
    if kind == 1:  # truncated
        return base[:rng.randrange(0, len(base))]
    if kind == 2:  # bytes flipped
        data = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 3:  # unknown or wrong tag, wrong version
        obj = msgpack.unpackb(base)
        obj[rng.randrange(2)] = rng.choice([0, 11, 99, -1, 2**40, "5", None, 1.5])
        return msgpack.packb(obj)
    if kind == 4:  # a valid message where another was expected
        return base
    if kind == 5:  # a message whose fields were shuffled or dropped
        obj = msgpack.unpackb(base)
        fields = obj[2:]
        rng.shuffle(fields)
        return msgpack.packb(obj[:2] + fields[:rng.randrange(len(fields) + 1)])
    return msgpack.packb(rng.choice([[], [1], {"a": 1}, [5, 1, {"x": [1] * 50}], "text",
                                     [[[[[]]]]], 2**63, [1, 1, b"\x00" * 40]]))


BAD_BODIES = [
    b"", b"{", b"[1, 2", b"nul", b"\xff\xfe\x00", b"[]", b"1", b'"text"', b"null", b"true",
    b'{"prompt": 123}', b'{"prompt": {"a": 1}}', b'{"prompt": "hi", "max_tokens": "ten"}',
    b'{"prompt": "hi", "max_tokens": 1e30}', b'{"prompt": "hi", "max_tokens": -3}',
    b'{"prompt": "hi", "max_tokens": 0}', b'{"prompt": "hi", "temperature": -1}',
    b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": -0.5}',
    b'{"prompt": "hi", "top_p": Infinity}', b'{"prompt": "hi", "n": 1000000000}',
    b'{"prompt": "hi", "logprobs": 1000000}', b'{"prompt": "hi", "seed": 1e400}',
    b'{"prompt": "hi", "presence_penalty": -1e308}', b'{"prompt": "hi", "top_k": -5}',
    b'{"prompt": "hi", "stop": [1, 2]}', b'{"prompt": ""}', b'{"prompt": []}',
    b'{"prompt": [[]]}', b'{"prompt": [-1, 99999999]}', b'{"prompt": "hi", "stream": "maybe"}',
    b'{"prompt": "hi", "model": "no-such-model"}', b'{"prompt": "hi", "n": 3, "best_of": 2}',
    b'{"messages": "hi"}', b'{"messages": []}', b'{"messages": [{"role": 1}]}',
    b'{"messages": [{"content": "hi"}]}', b'{"messages": [{"role": 7, "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999}',
    b'{"prompt": "hi", "max_tokens": 999999}',
]


def http_fuzz_requests(rng: random.Random):
    """(method, path, body, must_be_4xx) tuples."""
    for body in BAD_BODIES:
        path = "/v1/chat/completions" if b"messages" in body else rng.choice(
            ["/v1/completions", "/v1/chat/completions"])
        yield "POST", path, body, True
    huge = json.dumps({"prompt": "hello " * 100_000, "max_tokens": 1}).encode()
    yield "POST", "/v1/completions", huge, True
    yield "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hello " * 100_000}], "max_tokens": 1}).encode(), True
    yield "POST", "/v1/models", b"{}", True
    yield "DELETE", "/v1/completions", b"", True
    yield "GET", "/v1/no-such-route", b"", True
    hostile = [None, -1, 0, 2**64, 1e308, -1e308, "", "x" * 10000, [], {}, [None], True, "NaN"]
    keys = ["max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "seed", "stream",
            "echo", "user", "frequency_penalty", "min_tokens", "top_k", "ignore_eos"]
    while True:
        path = rng.choice(["/v1/completions", "/v1/chat/completions", "/health", "/metrics",
                           "/v1/models"])
        if path == "/v1/chat/completions":
            body = {"messages": rng.choice([[{"role": "user", "content": "hi"}],
                                            [{"role": "user"}], [{"role": "assistant"}],
                                            rng.choice(hostile)])}
        else:
            body = {"prompt": rng.choice(["hi", [1, 2, 3], rng.choice(hostile)])}
        for _ in range(rng.randrange(1, 4)):
            body[rng.choice(keys)] = rng.choice(hostile)
        if body.get("max_tokens") is None:
            body["max_tokens"] = 1  # a valid body must not run for long
        method = "POST" if path.startswith("/v1/c") else "GET"
        yield method, path, json.dumps(body).encode(), False


def test_fuzzed_frames_and_http_bodies_kill_nothing_and_get_no_500(stack):
    stack.wait_healthy()
    pids = stack.pids()
    cfg = stack.stack.stack_config
    rng = random.Random(20261129)
    valid = valid_frames()
    ctx = zmq.Context()
    sockets = []
    for addr in [cfg.request_input, cfg.engine_input] + [
            f"ipc://{os.path.join(cfg.run_dir, f)}" for f in os.listdir(cfg.run_dir)
            if f.startswith("client-")]:  # the gateway's return address
        sock = ctx.socket(zmq.PUSH)
        sock.connect(addr)
        sockets.append(sock)
    for addr in (cfg.worker_addr, cfg.detokenizer_addr):  # the engine's ROUTERs
        sock = ctx.socket(zmq.DEALER)
        sock.connect(addr)
        sockets.append(sock)
    for sock in sockets:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
    controls = [m.control_addr for m in stack.stack.members]
    sent = http_sent = 0
    statuses: dict[int, int] = {}
    wrong = []  # HTTP answers that should have been a 4xx
    bodies = http_fuzz_requests(rng)
    http = httpx.Client(base_url=stack.stack.gateway_url, timeout=60)
    try:
        oversized = b"\x00" * (MAX_FRAME_BYTES + 1)
        for sock in sockets:
            sock.send(oversized)
        # Random frames and bodies for 10 s, and every fixed bad body at least once.
        deadline = time.monotonic() + 10
        fixed_pending = True
        while time.monotonic() < deadline or fixed_pending:
            for _ in range(50):
                try:
                    rng.choice(sockets).send(random_frame(rng, valid), zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
            req = ctx.socket(zmq.REQ)  # a control socket answers anything, with an error
            req.setsockopt(zmq.LINGER, 0)
            req.setsockopt(zmq.RCVTIMEO, 10_000)
            req.connect(rng.choice(controls))
            req.send(random_frame(rng, valid))
            assert isinstance(decode(req.recv()), (ErrorResponse, HealthResponse))
            req.close()
            method, path, body, must_be_4xx = next(bodies)
            fixed_pending = must_be_4xx  # the fixed ones come first, then only random ones
            response = http.request(method, path, content=body,
                                    headers={"content-type": "application/json"})
            http_sent += 1
            status = response.status_code
            statuses[status] = statuses.get(status, 0) + 1
            if status >= 500 or must_be_4xx and not (
                    400 <= status < 500 and "error" in response.json()):
                wrong.append((status, method, path, body[:120], response.text[:200]))
    finally:
        http.close()
        ctx.destroy(linger=0)
    print(f"\nfuzz: {sent} frames to {len(sockets)} sockets, {http_sent} HTTP requests "
          f"(statuses {dict(sorted(statuses.items()))})")
    stack.wait_healthy()
    assert stack.pids() == pids, "a process died (and was restarted)"
    with httpx.Client(base_url=stack.stack.gateway_url, timeout=60) as http:
        ok = http.post("/v1/completions", json={"model": DEFAULT_MODEL_NAME, "prompt": "Hello",
                                                "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"], ok.text
    assert not wrong, wrong


# -- process deaths --------------------------------------------------------------------------------

def test_a_killed_tokenizers_requests_are_resent_and_all_complete_as_without_the_fault(
        stack, baseline):
    killed = {}

    def stop_it():  # stopped first, so the front door hands it half of the requests
        killed["pid"] = stack.kill("tokenizer", 0, signal.SIGSTOP)

    async def fault(results):
        await asyncio.sleep(1.0)
        stack.kill("tokenizer", 0, signal.SIGKILL)  # with the requests it holds

    results, generated, client = faulted_run(stack, "tok", fault, before=stop_it)
    assert_same_as_baseline(results, baseline)
    assert client.num_resubmits > 0, "no request was lost with the tokenizer: the test tested nothing"
    assert generated == NUM_REQUESTS * MAX_TOKENS, "a request ran twice"
    assert stack.pids()["tokenizer-0"] != killed["pid"]
    print(f"\ntokenizer killed: {client.num_resubmits} requests resent; all {NUM_REQUESTS} "
          f"complete, identical to the fault-free pass")


def test_a_killed_detokenizers_requests_move_and_stream_on_without_gaps_or_repeats(
        stack, baseline):
    before = stack.engine_details()["detokenizer_losses"]

    async def fault(results):
        await wait_until(mid_stream(results), 120, "every request to stream")
        stack.kill("detokenizer", 0)

    results, generated, _ = faulted_run(stack, "detok", fault)
    assert_same_as_baseline(results, baseline)
    assert generated == NUM_REQUESTS * MAX_TOKENS
    assert stack.engine_details()["detokenizer_losses"] > before


def test_a_killed_worker_is_replaced_and_every_request_completes_as_without_the_fault(
        stack, baseline):
    before = stack.engine_details()["worker_losses"]
    timing = {}

    async def fault(results):
        await wait_until(mid_stream(results), 120, "every request to stream")
        timing["killed"] = time.monotonic()
        stack.kill("worker", 0)

    results, generated, _ = faulted_run(stack, "worker", fault)
    assert_same_as_baseline(results, baseline)
    # Tokens of the discarded steps were never read, so none counts twice.
    assert generated == NUM_REQUESTS * MAX_TOKENS
    assert stack.engine_details()["worker_losses"] == before + 1
    print(f"\nworker killed: all {NUM_REQUESTS} requests done "
          f"{max(r.ended_at for r in results) - timing['killed']:.1f} s after the kill, "
          f"identical to the fault-free pass")
