"""CurveZMQ on the stack's sockets: real sockets with real keys, then one real stack on tcp
ports of 127.0.0.1 whose every process has keys, reached through the official `openai` client.

A peer with the keys talks; a peer without keys, or with a key that is not authorized, gets
nothing through (not a frame, not a health answer).
"""
import dataclasses
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import zmq
from zmq.utils import z85

from ops.compose import default_compose_file
from ops.launcher import LocalStack
from proto.codec import decode, encode
from proto.requests import GenerateRequest, HealthResponse, RequestAccepted, TextDeltas
from shared.curve import CurveKeys, CurveKeysError, create_keys, load_keys, start_authenticator
from shared.model_source import DEFAULT_MODEL_NAME
from shared.sampling_params import SamplingParams
from shared.sockets import (ControlServer, bind, bind_random_port, connect, make_socket,
                            probe_health)
from tests.test_compose import SERVICES, compose_config

ROOT = os.path.dirname(default_compose_file())
ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_model_len": 512}
PROMPT = "The capital of France is"
SILENCE_S = 1.0  # how long a refused peer is watched for a frame that must not come


@pytest.fixture(autouse=True)
def no_process_keys(monkeypatch):
    """This process has no keys of its own: a socket is keyed only where a test says so."""
    monkeypatch.delenv("PAGODA_CURVE_KEYS_DIR", raising=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> CurveKeys:
    return create_keys(str(tmp_path_factory.mktemp("curve") / "keys"))


def stranger(keys: CurveKeys) -> CurveKeys:
    """Knows the server's public key but holds a client keypair nobody authorized."""
    public, secret = zmq.curve_keypair()
    return dataclasses.replace(keys, client_public=public, client_secret=secret)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def short_dir():
    """For ipc paths, which have a length limit that pytest's tmp_path can pass."""
    path = tempfile.mkdtemp(prefix="pcrv-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def pull_server(ctx, keys) -> tuple[zmq.Socket, str]:
    sock = make_socket(ctx, zmq.PULL)
    return sock, bind_random_port(sock, "127.0.0.1", keys)


def push_to(ctx, addr: str, keys: CurveKeys | None) -> zmq.Socket:
    sock = make_socket(ctx, zmq.PUSH)
    connect(sock, addr, keys)
    return sock


# -- sockets ------------------------------------------------------------------------------------
def test_key_directory_is_readable_by_its_owner_only(keys):
    assert stat.S_IMODE(os.stat(keys.keys_dir).st_mode) == 0o700
    for folder, _, files in os.walk(keys.keys_dir):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o600, name
    assert sorted(os.listdir(keys.keys_dir)) == ["authorized", "client.key", "client.key_secret",
                                                 "server.key", "server.key_secret"]
    assert keys.authorized == {z85.decode(keys.client_public)}


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_keyed_client_and_server_exchange_messages(ctx, keys, short_dir, transport):
    server = make_socket(ctx, zmq.PULL)
    if transport == "tcp":
        addr = bind_random_port(server, "127.0.0.1", keys)
    else:
        addr = f"ipc://{short_dir}/curve.sock"
        bind(server, addr, keys)
    assert server.getsockopt(zmq.MECHANISM) == zmq.CURVE
    client = push_to(ctx, addr, keys)
    assert client.getsockopt(zmq.MECHANISM) == zmq.CURVE
    for i in range(3):
        client.send(b"frame %d" % i)
    assert server.poll(5000)
    assert [server.recv() for _ in range(3)] == [b"frame 0", b"frame 1", b"frame 2"]


def test_a_client_without_keys_gets_nothing_through(ctx, keys):
    server, addr = pull_server(ctx, keys)
    plain = push_to(ctx, addr, None)  # kept: a closed socket (linger 0) drops what it holds
    plain.send(b"in the clear")
    assert not server.poll(int(SILENCE_S * 1000))
    keyed = push_to(ctx, addr, keys)  # the server itself is fine
    keyed.send(b"keyed")
    assert server.poll(5000) and server.recv() == b"keyed"
    assert not server.poll(200)  # and the plain frame never follows


def test_a_client_with_an_unauthorized_key_gets_nothing_through(ctx, keys):
    server, addr = pull_server(ctx, keys)
    handler = start_authenticator(ctx, keys)
    refused_before = handler.denied
    unknown = push_to(ctx, addr, stranger(keys))
    unknown.send(b"from a stranger")
    assert not server.poll(int(SILENCE_S * 1000))
    assert handler.denied > refused_before  # its handshake was refused by the ZAP handler
    keyed = push_to(ctx, addr, keys)
    keyed.send(b"keyed")
    assert server.poll(5000) and server.recv() == b"keyed"
    assert not server.poll(200)


def test_health_probes_need_an_authorized_key(ctx, keys, short_dir):
    addr = f"ipc://{short_dir}/probe.ctl"
    control = ControlServer(ctx, addr, "test", lambda: ("ok", {}), curve=keys).start()
    try:
        health = probe_health(addr, 2.0, curve=keys)
        assert isinstance(health, HealthResponse) and health.status == "ok"
        assert probe_health(addr, SILENCE_S) is None
        assert probe_health(addr, SILENCE_S, curve=stranger(keys)) is None
    finally:
        control.close()


def test_a_context_with_a_curve_server_still_terminates_at_once(keys):
    """The ZAP handler ends with its context: the services' ctx.term() at shutdown returns."""
    context = zmq.Context()
    server, addr = pull_server(context, keys)
    client = push_to(context, addr, keys)
    client.send(b"x")
    assert server.poll(5000)
    server.close(0)
    client.close(0)
    done = threading.Event()
    threading.Thread(target=lambda: (context.term(), done.set()), daemon=True).start()
    assert done.wait(5), "ctx.term() hangs with the ZAP handler running"


def test_a_missing_or_incomplete_key_directory_fails_with_its_path(tmp_path):
    missing = str(tmp_path / "no-keys")
    with pytest.raises(CurveKeysError, match=re.escape(missing)):
        load_keys(missing)
    with pytest.raises(CurveKeysError, match=re.escape(missing)):
        LocalStack(run_dir=str(tmp_path / "run"), gateway=False, curve_keys_dir=missing)
    broken = str(tmp_path / "broken")  # never loaded (keys are read once per process)
    shutil.copytree(create_keys(str(tmp_path / "whole")).keys_dir, broken)
    os.remove(os.path.join(broken, "client.key_secret"))
    with pytest.raises(CurveKeysError, match=re.escape(os.path.join(broken, "client.key_secret"))):
        load_keys(broken)
    # A service refuses to start, saying why.
    out = subprocess.run([sys.executable, "-m", "pagoda", "detokenizer", "--curve-keys-dir",
                          missing], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and missing in out.stderr and "pagoda keys" in out.stderr


def test_pagoda_keys_creates_a_directory_and_refuses_to_replace_it(tmp_path):
    target = str(tmp_path / "stack-keys")
    cmd = [sys.executable, "-m", "pagoda", "keys", target]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "PAGODA_CURVE_KEYS_DIR" in first.stdout
    created = load_keys(target)
    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "already holds keys" in second.stdout
    assert load_keys(target) == created


def test_the_compose_override_gives_every_service_the_keys():
    config = compose_config("docker-compose.yml", "docker-compose.curve.yml")
    assert set(config["services"]) == SERVICES
    for name, service in config["services"].items():
        assert service["environment"]["PAGODA_CURVE_KEYS_DIR"] == "/keys", name
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in
                  service["volumes"]]
        assert any(m.split(":")[1] == "/keys" for m in mounts), (name, mounts)
        # The base file's settings stay.
        assert service["environment"]["PAGODA_REQUEST_INPUT"] == "tcp://engine:5555", name


# -- a stack with keys, on tcp ------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(keys):
    run_dir = tempfile.mkdtemp(prefix="pcrv-", dir="/tmp")  # ipc paths have a length limit
    launched = LocalStack(engine_args=ENGINE_ARGS, run_dir=run_dir, port=free_port(),
                          tcp_host="127.0.0.1", curve_keys_dir=keys.keys_dir)
    try:
        launched.start(timeout_s=300)
        yield launched
    finally:
        launched.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _engine(stack) -> dict:
    return probe_health(stack.stack_config.engine_control, 5.0, curve=stack.curve).details


def test_every_process_runs_with_the_keys_on_tcp(stack, keys):
    cfg = stack.stack_config
    for addr in (cfg.request_input, cfg.tokenizer_input, cfg.engine_input, cfg.worker_addr,
                 cfg.detokenizer_addr, cfg.engine_control):
        assert addr.startswith("tcp://127.0.0.1:"), addr
    for member in stack.members:
        with open(f"/proc/{member.popen.pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert env[b"PAGODA_CURVE_KEYS_DIR"].decode() == keys.keys_dir, member.name
        health = probe_health(member.control_addr, 2.0, curve=keys)
        assert health is not None and health.status == "ok", member.name


def test_a_greedy_completion_through_the_openai_client_equals_the_offline_llm(stack, llm):
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    out = client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPT, max_tokens=8,
                                    temperature=0.0)
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0]
    assert out.choices[0].text == expected.text and expected.text
    assert out.choices[0].finish_reason == ("length" if len(expected.token_ids) == 8 else "stop")


def test_health_probes_without_an_authorized_key_get_no_answer(stack, keys):
    probes = [(m.name, m.control_addr, curve) for m in stack.members
              for curve in (None, stranger(keys))]
    with ThreadPoolExecutor(len(probes)) as pool:  # each waits out its whole timeout
        answers = list(pool.map(lambda p: probe_health(p[1], SILENCE_S, curve=p[2]), probes))
    assert answers == [None] * len(probes), [p[0] for p, a in zip(probes, answers) if a]


def test_a_request_pushed_without_keys_never_runs(stack, keys, ctx):
    """The same valid GenerateRequest: pushed in the clear it never reaches the engine; pushed
    with the keys it runs and its text comes back."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = _engine(stack)["generation_tokens"]

    # In the clear, with a return address in the clear (nothing keyed could answer to it).
    plain_results = make_socket(ctx, zmq.PULL)
    port = plain_results.bind_to_random_port("tcp://127.0.0.1")
    plain = ctx.socket(zmq.PUSH)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(stack.stack_config.request_input)
    plain.send(encode(GenerateRequest("plain-1", f"tcp://127.0.0.1:{port}", PROMPT, params,
                                      time.time())))

    keyed_results, keyed_id = pull_server(ctx, keys)
    keyed = push_to(ctx, stack.stack_config.request_input, keys)
    keyed.send(encode(GenerateRequest("keyed-1", keyed_id, PROMPT, params, time.time())))
    finished, deadline = False, time.monotonic() + 60
    while not finished:
        assert keyed_results.poll(max(0, int((deadline - time.monotonic()) * 1000)))
        msg = decode(keyed_results.recv(), (TextDeltas, RequestAccepted))
        if isinstance(msg, TextDeltas):
            finished = any(s.finish_reason for r in msg.requests for s in r.sequences)

    assert not plain_results.poll(int(SILENCE_S * 1000))
    # Only the keyed request ran: its 4 tokens are all the engine generated.
    assert _engine(stack)["generation_tokens"] - before == 4

