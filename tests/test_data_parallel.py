"""Data parallelism: `pagoda serve --data-parallel-size 2` (two engines, each with its own worker
and KV cache, behind one tokenizer, detokenizer and gateway), with real processes, the real
model and the official `openai` client. One stack for the module; the offline `LLM` (one
engine) gives the outputs every request must match."""
import asyncio
import os
import re
import shutil
import tempfile

import httpx
import openai
import pytest
import zmq

from ops.compose import default_compose_file, load_services
from ops.launcher import LocalStack
from proto.codec import decode, encode
from proto.requests import ErrorResponse, GenerateRequest, HealthResponse
from services.gateway.replicas import EngineReplica, combined_health, least_loaded
from shared.model_source import DEFAULT_MODEL_NAME
from shared.sampling_params import SamplingParams
from shared.sockets import probe_health
from shared.stack_config import REPLICA_FIELDS, StackConfig
from tests.faults.stack_faults import SupervisedStack, free_port, wait_until

NUM_REQUESTS = 32
SHORT, LONG = 8, 24  # max_tokens: the spread test, and the kill test (streams still running)
SUBJECTS = ["the sea", "a mountain", "the moon", "a library", "coffee", "winter", "a robot",
            "the city at night"]
PROMPTS = [f"Request {i}: write one sentence about {SUBJECTS[i % len(SUBJECTS)]}."
           for i in range(NUM_REQUESTS)]
ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_model_len": 1024, "max_num_seqs": 32}
LIVENESS_S = 4.0  # how soon a dead peer is noticed


@pytest.fixture(scope="module")
def dp_stack():
    root = tempfile.mkdtemp(prefix="pdp-", dir="/tmp")  # short: ipc paths have a length limit
    supervised = SupervisedStack(LocalStack(
        engine_args={**ENGINE_ARGS, "data_parallel_size": 2}, run_dir=os.path.join(root, "s"),
        port=free_port(), env={"PAGODA_LIVENESS_TIMEOUT_S": str(LIVENESS_S)},
        keep_logs=True, hang_timeout_s=30, max_restarts_per_minute=10,
        # The workers' CPUs shared out: each replica's worker on its own, one thread a CPU.
        compose_vars={"PAGODA_WORKER_CPUS": ",".join(map(str, sorted(os.sched_getaffinity(0))))}))
    try:
        supervised.start()
        yield supervised
    finally:
        supervised.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def one_engine(llm) -> dict[int, list[str]]:
    """Each prompt's greedy text from one engine (the offline LLM), by max_tokens."""
    return {n: [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)]
            for n in (SHORT, LONG)}


def replica_details(stack: SupervisedStack) -> list[dict]:
    """Each engine replica's own health details ({} when it does not answer ok)."""
    out = []
    for addr in stack.stack.stack_config.replica_addresses("engine_control"):
        health = probe_health(addr, 5)
        out.append(health.details if health is not None and health.status == "ok" else {})
    return out


def openai_client(stack: SupervisedStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.stack.gateway_url + "/v1", api_key="unused",
                              max_retries=0, timeout=120)


# --- without processes -------------------------------------------------------------------------

def test_ipc_addresses_given_once_are_derived_per_replica(monkeypatch, tmp_path):
    for name in REPLICA_FIELDS + ("replica",):
        monkeypatch.delenv("PAGODA_" + name.upper(), raising=False)
    stack = StackConfig(run_dir=str(tmp_path))
    stack.use_replicas(2)
    inputs = stack.replica_addresses("engine_input")
    assert len(set(inputs)) == 2 and stack.engine_input == inputs[0]
    # A process of replica 1, started with the stack's environment, takes replica 1's.
    monkeypatch.setattr(os, "environ", {**stack.to_env(), "PAGODA_REPLICA": "1"})
    other = StackConfig()
    assert other.replica == 1 and other.num_replicas == 2
    for name in REPLICA_FIELDS:
        assert getattr(other, name) == stack.replica_addresses(name)[1]
    assert other.control_for("worker", 0) != stack.control_for("worker", 0)


def test_tcp_addresses_must_be_given_once_per_replica(tmp_path):
    stack = StackConfig(run_dir=str(tmp_path), engine_input="tcp://engine:5557")
    with pytest.raises(ValueError, match="^engine_input: 1 address"):
        stack.use_replicas(2)


def _health(status, **details):
    return HealthResponse("engine", status, details)


def test_a_request_goes_to_the_least_loaded_live_replica():
    a, b, c = (EngineReplica(k, f"ipc://{k}") for k in range(3))
    a.observe(_health("ok", running=4, waiting=2), 1.0)
    b.observe(_health("ok", running=3, waiting=0), 1.0)
    c.observe(_health("ok", running=0, waiting=0), 1.0)
    c.ok = False
    assert least_loaded([a, b, c], 0) is b
    b.sent_since_answer = 4  # sent since its last report: counted
    assert least_loaded([a, b, c], 0) is a
    a.ok = b.ok = False
    assert least_loaded([a, b, c], 0) is None


def test_the_stacks_health_counts_every_replica_and_one_down_is_degraded():
    up = _health("ok", running=2, workers=1, tokenizers=1, detokenizers=1, generation_tokens=5)
    assert combined_health([up]) is up
    both = combined_health([up, _health("ok", running=1, workers=1, tokenizers=1,
                                        detokenizers=1, generation_tokens=7)])
    assert both.status == "ok" and both.details["running"] == 3
    assert both.details["workers"] == 2 and both.details["tokenizers"] == 1
    assert both.details["generation_tokens"] == 12
    one = combined_health([up, None])
    assert one.status == "degraded" and one.details["replicas_ok"] == 1
    assert one.details["replica1_status"] == "down" and one.details["workers"] == 1
    assert combined_health([None, None]) is None
    assert combined_health([_health("starting"), None]).status == "starting"


def test_the_dp2_compose_override_reads_the_same_for_docker_compose_and_the_launcher(
        tmp_path):
    from tests.test_compose import argv_of, compose_config
    files = ["docker-compose.yml", "docker-compose.dp2.yml"]
    config = compose_config(*files)["services"]
    root = os.path.dirname(default_compose_file())
    specs = load_services([os.path.join(root, f) for f in files],
                          env={k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")})
    assert set(specs) == set(config) >= {"engine", "engine-1", "worker", "worker-1"}
    for name, spec in specs.items():
        assert ["pagoda", spec.command, *spec.args] == argv_of(config[name]), name
        assert spec.environment == config[name]["environment"], name
    for name in ("engine", "worker", "engine-1", "worker-1"):
        replica = int(config[name]["environment"]["PAGODA_REPLICA"])
        assert replica == (1 if name.endswith("-1") else 0)
    # The launcher runs each listed replica once, on that replica's own addresses.
    stack = LocalStack([os.path.join(root, f) for f in files], run_dir=str(tmp_path))
    stack._plan()
    assert stack.replicas == 2
    by_name = {m.name: m for m in stack.members}
    assert {"engine-0", "engine-1-0", "worker-0", "worker-1-0"} <= set(by_name)
    assert len(stack.members) == 7
    for name, replica in (("engine-0", 0), ("engine-1-0", 1), ("worker-1-0", 1)):
        m = by_name[name]
        assert m.env["PAGODA_REPLICA"] == str(replica)
    assert by_name["engine-1-0"].control_addr == stack.stack_config.replica_addresses(
        "engine_control")[1]


def test_bench_serve_passes_data_parallel_size_to_pagoda_serve():
    import argparse
    import shlex

    from ops import serve_cli
    from ops.bench.serve_servers import PagodaServer
    serve_args = shlex.split("--data-parallel-size 2")
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert parser.parse_args(serve_args).data_parallel_size == 2
    server = PagodaServer({}, tempfile.gettempdir(), "dp", serve_args)
    assert server.command[server.command.index("serve") + 1:].count("--data-parallel-size") == 1


# --- a running stack -----------------------------------------------------------------------------

def test_the_launcher_starts_an_engine_and_a_worker_per_replica(dp_stack):
    members = {(m.name, m.replica) for m in dp_stack.stack.members}
    assert {("engine-0", 0), ("engine-1", 1), ("worker-0", 0), ("worker-1", 1)} <= members
    details = replica_details(dp_stack)
    assert [d.get("replica") for d in details] == [0, 1]
    for d in details:  # each replica sees the shared services and its own worker
        assert d["workers"] == 1 and d["tokenizers"] == 1 and d["detokenizers"] == 1
    body = httpx.get(dp_stack.stack.gateway_url + "/health", timeout=30).json()
    assert body["status"] == "ok" and body["replicas"] == 2 and body["replicas_ok"] == 2
    assert body["workers"] == 2


def test_a_request_for_a_replica_the_stack_lacks_gets_a_400_naming_the_field(dp_stack):
    cfg = dp_stack.stack.stack_config
    ctx = zmq.Context()
    try:
        results = ctx.socket(zmq.PULL)
        gateway_id = f"ipc://{cfg.run_dir}/client-dp-test.sock"
        results.bind(gateway_id)
        requests = ctx.socket(zmq.PUSH)
        requests.connect(cfg.request_input)
        requests.send(encode(GenerateRequest("bad-replica", gateway_id, "Hello",
                                             SamplingParams(max_tokens=2), 0.0, replica=7)))
        assert results.poll(30_000), "no answer"
        answer = decode(results.recv())
        assert isinstance(answer, ErrorResponse) and answer.request_id == "bad-replica"
        assert answer.code == 400 and answer.message.startswith("replica: 7 ")
    finally:
        ctx.destroy(linger=0)


def test_requests_spread_over_both_replicas_with_the_outputs_of_one_engine(dp_stack, one_engine):
    dp_stack.wait_healthy()
    before = [int(d["generation_tokens"]) for d in replica_details(dp_stack)]

    async def main():
        client = openai_client(dp_stack)
        try:
            return await asyncio.gather(*(client.completions.create(
                model=DEFAULT_MODEL_NAME, prompt=p, max_tokens=SHORT, temperature=0)
                for p in PROMPTS))
        finally:
            await client.close()
    completions = asyncio.run(main())
    after = [int(d["generation_tokens"]) for d in replica_details(dp_stack)]
    generated = [a - b for a, b in zip(after, before)]
    # Counted by the engines themselves: each did a fair share, and together all of it.
    assert sum(generated) == sum(c.usage.completion_tokens for c in completions)
    assert min(generated) >= sum(generated) // 4, generated
    assert [c.choices[0].text for c in completions] == one_engine[SHORT]


def test_a_killed_replicas_requests_finish_on_the_other_with_the_same_text(dp_stack,
                                                                            one_engine):
    dp_stack.wait_healthy()
    texts = [""] * NUM_REQUESTS
    streaming = [False] * NUM_REQUESTS
    seen: dict = {}

    async def stream(client, i):
        chunks = await client.completions.create(model=DEFAULT_MODEL_NAME, prompt=PROMPTS[i],
                                                 max_tokens=LONG, temperature=0, stream=True)
        async for chunk in chunks:
            streaming[i] = True  # (some prompts end at once: their one chunk has no text)
            if chunk.choices:
                texts[i] += chunk.choices[0].text

    async def kill_replica_1():
        await wait_until(lambda: all(streaming), 120, "every stream to start")
        seen["running"] = (await asyncio.to_thread(replica_details, dp_stack))[1].get("running")
        dp_stack.kill("engine", 1)
        async with httpx.AsyncClient(base_url=dp_stack.stack.gateway_url, timeout=30) as http:
            for _ in range(100):  # the gateway reports the loss (and still serves)
                response = await http.get("/health")
                if response.json()["status"] == "degraded":
                    seen["health"] = (response.status_code, response.json())
                    return
                await asyncio.sleep(0.1)

    async def main():
        client = openai_client(dp_stack)
        try:
            await asyncio.wait_for(asyncio.gather(
                *(stream(client, i) for i in range(NUM_REQUESTS)), kill_replica_1()), 180)
        finally:
            await client.close()
    asyncio.run(main())
    assert seen["running"], "replica 1 had no request running when it was killed"
    assert "health" in seen, "the gateway's /health never said degraded"
    status, body = seen["health"]
    assert status == 200 and body["replicas_ok"] == 1 and "1" in body["message"], body
    assert texts == one_engine[LONG]
    # They went on from their output so far, on the replica left (the gateway's log says so).
    gateway = next(m for m in dp_stack.stack.members if m.service == "gateway")
    with open(gateway.log_path) as f:
        moved = re.findall(r"request moved to another engine replica +from_replica=1 .*"
                           r"resumed_tokens=(\d+)", f.read())
    assert moved, "no request was moved off the killed replica"
    assert max(map(int, moved)) > 0, "the moved requests carried no output"
