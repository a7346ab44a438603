"""vLLM's extra endpoints (/tokenize, /detokenize, /version), model cards and served-model-name
aliases, and the vllm: metric families, against the session stack."""
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import MAX_MODEL_LEN, MODEL, MODEL_ALIAS

TEXT = "Hello world, how are you today?"


def test_tokenize_and_detokenize_round_trip(http):
    r = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) > 3
    assert out["max_model_len"] == MAX_MODEL_LEN
    assert len(out["token_strs"]) == out["count"]
    assert http.post("/tokenize", json={"prompt": TEXT}).json()["token_strs"] is None
    back = http.post("/detokenize", json={"tokens": out["tokens"], "model": MODEL})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_tokenize_counts_what_a_request_is_charged(http, client):
    usage = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage
    assert http.post("/tokenize", json={"prompt": TEXT}).json()["count"] == usage.prompt_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    tokens = http.post("/tokenize", json={"messages": messages}).json()
    assert tokens["count"] == chat.usage.prompt_tokens
    # Without the generation prompt the rendered chat is shorter.
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert bare.json()["count"] < tokens["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "no-such-model"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x", "unknown_field": 1}, "unknown_field"),
    ("/detokenize", {"tokens": [10 ** 8]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_version(http):
    r = http.get("/version")
    assert r.status_code == 200
    version = r.json()["version"]
    assert isinstance(version, str) and version[0].isdigit()


def test_model_cards_and_unknown_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, MODEL_ALIAS]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.max_model_len == MAX_MODEL_LEN and card.root
    assert client.models.retrieve(MODEL_ALIAS).id == MODEL_ALIAS
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"
    assert err.value.body["param"] == "model"


def test_served_model_name_aliases_are_accepted_and_the_first_reported(client):
    out = client.completions.create(model=MODEL_ALIAS, prompt=TEXT, max_tokens=1)
    assert out.model == MODEL
    chat = client.chat.completions.create(model=MODEL_ALIAS, max_tokens=1,
                                          messages=[{"role": "user", "content": TEXT}])
    assert chat.model == MODEL
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=TEXT, max_tokens=1)


def _scrape(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    return {s.name: s.value for family in text_string_to_metric_families(r.text)
            for s in family.samples if s.labels.get("model_name") == MODEL}


# vLLM's metric names (its tests/entrypoints/openai/test_metrics.py), as samples.
VLLM_SAMPLES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total",
    *[f"vllm:{name}_{suffix}" for name in (
        "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
        "request_params_n", "request_params_max_tokens", "time_per_output_token_seconds",
        "inter_token_latency_seconds", "time_to_first_token_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for suffix in ("sum", "count")],
]


def test_vllm_metric_families_count_a_request(http, client):
    before = _scrape(http)
    prompt_tokens = http.post("/tokenize", json={"prompt": TEXT}).json()["count"]
    client.completions.create(model=MODEL, prompt=TEXT, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _scrape(http)
    missing = [name for name in VLLM_SAMPLES if name not in after]
    assert not missing

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:prompt_tokens_total") == prompt_tokens
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert grew("vllm:request_generation_tokens_sum") == 5
    assert grew("vllm:request_params_max_tokens_sum") == 5
    assert grew("vllm:request_params_n_sum") == 1
    assert grew("vllm:iteration_tokens_total_sum") == prompt_tokens + 5
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens"):
        assert grew(f"vllm:{name}_count") == 1, name
    assert grew("vllm:time_per_output_token_seconds_count") == 4
    # Aliases: the vllm: families hold the pagoda: ones' values.
    assert after["vllm:prompt_tokens_total"] == after["pagoda:prompt_tokens_total"]
    assert (after["vllm:inter_token_latency_seconds_sum"]
            == after["pagoda:time_per_output_token_seconds_sum"])
    assert after["vllm:num_requests_running"] == 0
