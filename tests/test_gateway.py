"""The HTTP gateway against a real stack (engine, worker, tokenizer, detokenizer, gateway
processes), through the official `openai` client, sync and async.

One stack serves the module; two more gateways share it: a tight one (1 pending request, 3 s
request timeout) and one whose stack is absent (stopped with SIGTERM by the last test). Outputs
are kept short: this runs on CPUs.
"""
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ops.launcher import LocalStack, local_stack_config
from services.gateway.main import raise_open_files_limit
from shared.model_source import DEFAULT_MODEL_NAME
from shared.sockets import probe_health

API_KEY = "test-key"
MODEL = DEFAULT_MODEL_NAME
MAX_MODEL_LEN = 512
ENGINE_ARGS = {"kv_cache_space_gib": 0.25, "max_model_len": MAX_MODEL_LEN}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExtraGateway:
    """A `pagoda gateway` process beside the stack's own, with its own flags."""

    def __init__(self, stack_env: dict, log_dir: str, instance: str, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"gateway-{instance}.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
        env.update(stack_env, PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "pagoda", "gateway", "--port", str(self.port),
                 "--instance", instance, *flags], env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, open(self.log_path).read()[-3000:]
            try:
                httpx.get(self.url + "/v1/models", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.5)
        raise TimeoutError(f"gateway on {self.url} not up: {open(self.log_path).read()[-3000:]}")

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()


@pytest.fixture(scope="module")
def stack():
    root = tempfile.mkdtemp(prefix="pgw-", dir="/tmp")  # short: ipc paths have a length limit
    run_dir, down_dir = os.path.join(root, "stack"), os.path.join(root, "down")
    os.makedirs(down_dir)
    # A busy CPU can stall the engine's loop for seconds: keep peers counted as live meanwhile.
    stack = LocalStack(engine_args=ENGINE_ARGS, run_dir=run_dir, port=_free_port(),
                       api_key=API_KEY, env={"PAGODA_LIVENESS_TIMEOUT_S": "60"})
    env = stack.stack_config.to_env()
    tight = ExtraGateway(env, root, "1", "--max-pending-requests", "1",
                         "--request-timeout", "3")
    # No engine ever answers this one; its request timeout is long past by the time it is asked.
    # (Its log beside, not in, its run directory: stopped, it must leave that empty.)
    down = ExtraGateway(local_stack_config(down_dir).to_env(), root, "0",
                        "--request-timeout", "2")
    try:
        stack.start(timeout_s=300)
        tight.wait_listening(120)
        down.wait_listening(120)
        stack.tight, stack.down, stack.down_dir = tight, down, down_dir
        yield stack
    finally:
        for g in (tight, down):
            g.stop()
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture
def aclient(stack):
    return openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key=API_KEY,
                              max_retries=0, timeout=120)


def greedy(**extra):
    return dict(model=MODEL, temperature=0.0, **extra)


def engine_health(stack):
    return probe_health(stack.stack_config.engine_control, timeout_s=2.0)


def wait_engine_idle(stack, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        details = engine_health(stack).details
        if details["running"] == 0 and details["waiting"] == 0 and details["kv_cache_usage"] == 0:
            return details
        assert time.monotonic() < deadline, f"engine still busy: {details}"
        time.sleep(0.25)


def scrape(url: str) -> dict[str, list]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def sample_sum(families: dict, family: str, suffix: str = "", **labels) -> float:
    return sum(s.value for s in families.get(family, []) if s.name == family + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


# -- information ----------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_health_reports_every_service(stack):
    r = httpx.get(stack.gateway_url + "/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["workers"] >= 1 and body["tokenizers"] >= 1 and body["detokenizers"] >= 1


# -- completions ----------------------------------------------------------------------------------
def test_greedy_completion_equals_offline_llm(client, llm):
    from pagoda import SamplingParams
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0]
    out = client.completions.create(prompt=PROMPT, max_tokens=8, **greedy())
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == MODEL
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == ("length" if len(expected.token_ids) == 8 else "stop")
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_greedy_chat_equals_offline_llm_chat(aclient, llm):
    from pagoda import SamplingParams
    expected = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0]

    async def ask():
        return await aclient.chat.completions.create(messages=CHAT, max_completion_tokens=8,
                                                     **greedy())
    out = asyncio.run(ask())
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.completion_tokens == len(expected.token_ids)


def test_prompts_and_samples_get_openai_choice_indices(client):
    # Two token-id prompts x n=2: prompt i's sample j is choice 2i + j.
    out = client.completions.create(model=MODEL, prompt=[[504, 3575, 282], [504, 3575]], n=2,
                                    max_tokens=3, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage.completion_tokens == 4 * 3
    assert out.usage.prompt_tokens == 3 + 2


def test_stop_string_ends_the_completion(client):
    out = client.completions.create(prompt=PROMPT, max_tokens=8, stop=["."], **greedy())
    choice = out.choices[0]
    assert "." not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "."


def test_echo_repeats_text_and_token_id_prompts(client, llm):
    token_ids = llm.get_tokenizer().encode(PROMPT)
    plain = client.completions.create(prompt=PROMPT, max_tokens=2, **greedy())
    for prompt in (PROMPT, token_ids):
        echoed = client.completions.create(prompt=prompt, max_tokens=2, echo=True, **greedy())
        assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_completion_logprobs_list_tokens_offsets_and_alternatives(client):
    plain = client.completions.create(prompt=PROMPT, max_tokens=2, logprobs=2, **greedy())
    lp = plain.choices[0].logprobs
    assert "".join(lp.tokens) == plain.choices[0].text
    assert len(lp.token_logprobs) == 2 and all(v <= 0 for v in lp.token_logprobs)
    # Greedy: the chosen token is the most likely one of its alternatives.
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == value and top[token] == value
    assert lp.text_offset == [0, len(lp.tokens[0])]


def test_chat_logprobs_list_top_alternatives(client):
    out = client.chat.completions.create(messages=CHAT, max_tokens=2, logprobs=True,
                                         top_logprobs=2, **greedy())
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob


def test_chat_stream_sends_role_content_finish_usage_and_done(client):
    stream = client.chat.completions.create(messages=CHAT, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, **greedy())
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] is not None and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full = client.chat.completions.create(messages=CHAT, max_tokens=4, **greedy())
    assert text == full.choices[0].message.content


def test_32_concurrent_streams_complete_in_order_equal_to_non_streamed(aclient):
    prompts = [f"Question {i}: what comes after {i}? Answer:" for i in range(32)]

    async def plain(prompt):
        out = await aclient.completions.create(prompt=prompt, max_tokens=4, **greedy())
        return out.choices[0]

    async def streamed(prompt):
        chunks = [c async for c in await aclient.completions.create(
            prompt=prompt, max_tokens=4, stream=True, **greedy())]
        return chunks

    async def both():
        texts = await asyncio.gather(*(plain(p) for p in prompts))
        streams = await asyncio.gather(*(streamed(p) for p in prompts))
        return texts, streams

    choices, streams = asyncio.run(both())
    for choice, chunks in zip(choices, streams):
        assert len({c.id for c in chunks}) == 1
        reasons = [c.choices[0].finish_reason for c in chunks]
        assert reasons[-1] == choice.finish_reason and all(r is None for r in reasons[:-1])
        assert "".join(c.choices[0].text for c in chunks) == choice.text


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 1.5), ("n", 0),
                                         ("max_tokens", 0), ("logprobs", 30), ("top_k", -5),
                                         ("min_p", 2.0), ("repetition_penalty", 0.0),
                                         ("bogus_field", 1)])
def test_bad_field_is_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={field: value})
    body = err.value.body
    assert err.value.status_code == 400
    assert body["type"] == "invalid_request_error" and body["param"] == field
    assert field in body["message"]


def test_bad_chat_message_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"


def test_chat_user_message_without_content_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}])
    assert err.value.body["param"] == "messages[0].content"
    assert "content" in err.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_too_long_prompt_is_400_with_the_numbers(client, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[1] * 600, max_tokens=4, stream=stream)
    body = err.value.body
    assert body["param"] == "prompt"
    assert str(MAX_MODEL_LEN) in body["message"] and "600" in body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-17", prompt=PROMPT)
    assert err.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_missing_or_wrong_api_key_is_401(stack, headers):
    r = httpx.post(stack.gateway_url + "/v1/completions", headers=headers,
                   json={"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_with_a_wrong_key_gets_authentication_error(stack):
    wrong = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_health_and_metrics_need_no_api_key(stack):
    assert httpx.get(stack.gateway_url + "/health").status_code == 200
    assert httpx.get(stack.gateway_url + "/metrics").status_code == 200


def test_requests_past_the_pending_limit_get_429_at_once(stack):
    tight = openai.OpenAI(base_url=stack.tight.url + "/v1", api_key="none", max_retries=0)
    stream = tight.completions.create(prompt=PROMPT, max_tokens=400, stream=True,
                                      extra_body={"ignore_eos": True}, **greedy())
    try:
        next(iter(stream))
        start = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            tight.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert time.monotonic() - start < 2
        assert err.value.body["code"] == "rate_limit_exceeded"
    finally:
        stream.close()
    wait_engine_idle(stack)


def test_a_burst_of_a_thousand_requests_is_served_without_a_refusal(stack):
    """vLLM's benchmark client sends 1,000 requests at once by default: by default a gateway
    takes them all in (no pending limit) and the engine queues them."""
    # This process holds the 1,000 client connections: it needs the file descriptors too.
    _, limit = raise_open_files_limit()
    if limit != -1 and limit < 2100:
        pytest.skip(f"this process may open {limit} files; 1,000 connections need ~2,000")

    async def burst():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with openai.AsyncOpenAI(
                base_url=stack.gateway_url + "/v1", api_key=API_KEY, max_retries=0,
                timeout=300, http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as c:
            return await asyncio.gather(*(c.completions.create(
                prompt=f"{i}:", max_tokens=1, **greedy()) for i in range(1000)),
                return_exceptions=True)

    results = asyncio.run(burst())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of 1000 failed, e.g. {errors[0]!r}"
    assert all(len(r.choices) == 1 and r.usage.completion_tokens == 1 for r in results)
    wait_engine_idle(stack)


def test_an_engine_away_for_longer_than_the_request_timeout_is_503_at_once(stack):
    down = openai.OpenAI(base_url=stack.down.url + "/v1", api_key="none", max_retries=0)
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        down.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert err.value.status_code == 503
    assert time.monotonic() - start < 3
    assert "engine" in err.value.body["message"]
    health = httpx.get(stack.down.url + "/health")
    assert health.status_code == 503 and health.json()["missing"] == ["engine"]


def test_engine_that_stops_answering_ends_requests_with_an_error(stack):
    tight = openai.OpenAI(base_url=stack.tight.url + "/v1", api_key="none", max_retries=0)
    stream = tight.completions.create(prompt=PROMPT, max_tokens=400, stream=True,
                                      extra_body={"ignore_eos": True}, **greedy())
    chunks = iter(stream)
    next(chunks)
    stack.kill("engine", sig=signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
        elapsed = time.monotonic() - start
    finally:
        stack.kill("engine", sig=signal.SIGCONT)
    assert "no output from the engine" in err.value.message
    # The 3 s run from the last output, which came a moment before the engine was stopped.
    assert 2.5 <= elapsed < 15
    wait_engine_idle(stack)

    # Not streamed: a 503 once the request timeout passes.
    async def stalled():
        async with openai.AsyncOpenAI(base_url=stack.tight.url + "/v1", api_key="none",
                                      max_retries=0) as c:
            task = asyncio.create_task(c.completions.create(
                prompt=PROMPT, max_tokens=400, extra_body={"ignore_eos": True}, **greedy()))
            while engine_health(stack).details["running"] == 0:
                await asyncio.sleep(0.2)
            stack.kill("engine", sig=signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(openai.InternalServerError) as err:
                    await task
                return err.value, time.monotonic() - start
            finally:
                stack.kill("engine", sig=signal.SIGCONT)
    error, elapsed = asyncio.run(stalled())
    assert error.status_code == 503 and elapsed < 15
    wait_engine_idle(stack)


# -- aborts ---------------------------------------------------------------------------------------
def test_client_disconnect_mid_stream_frees_the_request_blocks(client, stack):
    stream = client.completions.create(prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True}, **greedy())
    chunks = iter(stream)
    next(chunks), next(chunks)
    details = engine_health(stack).details
    assert details["running"] == 1 and details["kv_cache_usage"] > 0
    stream.close()
    wait_engine_idle(stack, timeout_s=10)


def test_client_disconnect_while_waiting_frees_the_request_blocks(stack):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.gateway_url + "/v1/completions", timeout=4,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 400,
                         "ignore_eos": True, "temperature": 0})
    wait_engine_idle(stack, timeout_s=10)


# -- metrics --------------------------------------------------------------------------------------
def test_metrics_parse_and_counters_move_with_traffic(client, stack):
    before = scrape(stack.gateway_url)
    out = client.completions.create(prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True},
                                    **greedy())
    after = scrape(stack.gateway_url)

    def gained(family, suffix="", **labels):
        return (sample_sum(after, family, suffix, **labels)
                - sample_sum(before, family, suffix, **labels))

    assert gained("pagoda:generation_tokens", "_total") == 3
    assert gained("pagoda:prompt_tokens", "_total") == out.usage.prompt_tokens
    assert gained("pagoda:request_success", "_total", finished_reason="length") == 1
    for histogram in ("pagoda:time_to_first_token_seconds", "pagoda:e2e_request_latency_seconds",
                      "pagoda:request_queue_time_seconds"):
        assert gained(histogram, "_count") == 1
    assert gained("pagoda:time_per_output_token_seconds", "_count") == 2
    for service in ("engine", "worker", "tokenizer", "detokenizer", "gateway"):
        assert sample_sum(after, "pagoda:service_up", service=service) == 1
    for gauge in ("pagoda:num_requests_running", "pagoda:num_requests_waiting",
                  "pagoda:num_requests_swapped", "pagoda:kv_cache_usage_perc",
                  "pagoda:prefix_cache_hit_rate"):
        assert gauge in after


# -- lifecycle ------------------------------------------------------------------------------------
def test_gateway_stops_cleanly_on_sigterm(stack):
    """The gateway whose stack is absent, after its last use (this is the module's last test):
    no third gateway is started for this."""
    gateway, run_dir = stack.down, stack.down_dir
    assert probe_health(local_stack_config(run_dir).control_for("gateway", 0)).status == "ok"
    gateway.popen.send_signal(signal.SIGTERM)
    assert gateway.popen.wait(15) == 0
    assert "gateway stopped" in open(gateway.log_path).read()
    assert os.listdir(run_dir) == []  # its control and return sockets are gone
