"""vLLM's request extensions and OpenAI's remaining request fields, against the session stack:
each changes the output as vLLM's and OpenAI's docs say, and a bad value is a 400 naming it."""
import json
import uuid

import openai
import pytest

from tests.api.conftest import MAX_MODEL_LEN, MODEL

PROMPT = "The capital of France is"
# A chat turn written out as the model's own format, so that the model ends it with its
# end-of-turn token whatever chat template the stack serves.
CHAT_TURN = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
             "<|im_start|>assistant\n")
GREEDY = {"temperature": 0.0}
BLOCK_SIZE = 16  # the stack's KV block size (the default)


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(http, prompt: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": prompt})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY).choices[0].text
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    cut = text.index(stop)
    without = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=[stop], **GREEDY)
    with_stop = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=[stop],
                                          extra_body={"include_stop_str_in_output": True},
                                          **GREEDY)
    assert without.choices[0].text == text[:cut]
    assert with_stop.choices[0].text == text[:cut + len(stop)]
    assert with_stop.choices[0].finish_reason == "stop"


def test_min_tokens_holds_off_a_stop_token(http):
    natural = complete(http, max_tokens=8, return_token_ids=True)["choices"][0]["token_ids"]
    stop_id = natural[1]  # the greedy output's second token ends it at once...
    stopped = complete(http, max_tokens=8, stop_token_ids=[stop_id])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 2
    # ... until min_tokens have been generated.
    held = complete(http, max_tokens=8, min_tokens=6, stop_token_ids=[stop_id])
    assert held["usage"]["completion_tokens"] >= 6


def test_skip_special_tokens_decides_whether_the_end_of_turn_token_shows(http):
    body = {"prompt": CHAT_TURN, "max_tokens": 10, "ignore_eos": True, "return_token_ids": True}
    shown = complete(http, skip_special_tokens=False, **body)["choices"][0]
    hidden = complete(http, **body)["choices"][0]
    end_of_turn = tokenize(http, "<|im_end|>")
    assert len(end_of_turn) == 1 and end_of_turn[0] in shown["token_ids"]
    assert shown["token_ids"] == hidden["token_ids"]
    assert "<|im_end|>" in shown["text"]
    assert "<|im_end|>" not in hidden["text"] and hidden["text"]


def test_return_token_ids_match_tokenize_and_detokenize(http):
    out = complete(http, return_token_ids=True, max_tokens=5)
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == tokenize(http, PROMPT)
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == 5
    text = http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert text == choice["text"]
    assert "token_ids" not in complete(http)["choices"][0]  # only when asked

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "return_token_ids": True, **GREEDY}).json()
    expected = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat["prompt_token_ids"] == expected
    assert chat["usage"]["prompt_tokens"] == len(expected)
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]


def test_return_token_ids_streamed(http):
    ids, prompt_ids, text, usages = [], None, "", []
    with http.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **GREEDY}) as r:
        for chunk in _events(r):
            for choice in chunk["choices"]:
                prompt_ids = prompt_ids or choice.get("prompt_token_ids")
                ids += choice["token_ids"]
                text += choice["text"]
            usages.append((bool(chunk["choices"]), chunk["usage"]))
    assert prompt_ids == tokenize(http, PROMPT)
    assert len(ids) == 4
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
    # Without continuous_usage_stats only the final chunk has the usage.
    assert all(u is None for has_choices, u in usages if has_choices)
    has_choices, usage = usages[-1]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert not has_choices and 0 <= cached < len(prompt_ids)
    assert usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": 4,
                     "total_tokens": len(prompt_ids) + 4}


def test_cached_tokens_in_the_usage_count_the_prompt_found_in_the_prefix_cache(client):
    # The stack runs with --enable-prompt-tokens-details (conftest.py). A new prompt: nothing
    # of it is cached; sent again, its whole blocks are (all but the last token, which is
    # always computed), and the usage says so in every form of response.
    prompt = f"{uuid.uuid4().hex} " + " ".join([PROMPT + " Paris."] * 8)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    n = first.usage.prompt_tokens
    hit = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert n > 2 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == hit
    # Several prompts in one request: their hits add up.
    both = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=1)
    assert both.usage.prompt_tokens_details.cached_tokens == 2 * hit
    # Streamed with include_usage: the final chunk's usage.
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, stream=True,
                                       stream_options={"include_usage": True})
    assert [c.usage for c in stream if c.usage][-1].prompt_tokens_details.cached_tokens == hit

    # Chat, streamed and not.
    messages = [{"role": "user", "content": prompt + " Again."}]

    def streamed_chat() -> tuple[int, int]:
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, stream=True,
            stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None][-1]
        return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
    m, chat_first = streamed_chat()
    chat_hit = (m - 1) // BLOCK_SIZE * BLOCK_SIZE
    # The chat template's opening may be cached from other chats, the prompt's text is not.
    assert chat_first < chat_hit
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens == chat_hit
    assert streamed_chat() == (m, chat_hit)


def test_prompt_logprobs_cover_the_prompt_with_the_first_null(http):
    prompt = PROMPT + " Paris"
    out = complete(http, prompt=prompt, prompt_logprobs=2, max_tokens=1)
    ids = tokenize(http, prompt)
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) == out["usage"]["prompt_tokens"]
    assert plp[0] is None
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert str(ids[pos]) in entry and 2 <= len(entry) <= 3
        top = sorted((v for k, v in entry.items() if v["rank"] is not None),
                     key=lambda v: v["rank"])
        assert [v["rank"] for v in top][:2] == [1, 2]
        assert all(v["logprob"] <= 0 for v in entry.values())
        assert top[0]["logprob"] >= max(v["logprob"] for v in entry.values())
    # The prompt's last token scores as the same token does when it is generated next.
    generated = complete(http, logprobs=0, max_tokens=1)["choices"][0]["logprobs"]
    last = plp[-1][str(ids[-1])]
    assert last["decoded_token"] == generated["tokens"][0] == " Paris"
    assert last["logprob"] == pytest.approx(generated["token_logprobs"][0], abs=2e-3)

    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0,
        **GREEDY}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_echo_with_logprobs_returns_the_prompt_tokens_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, **GREEDY)
    choice, usage = out.choices[0], out.usage
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:usage.prompt_tokens]) == PROMPT
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(lp.tokens))]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http):
    out = complete(http, max_tokens=3, echo=True, logprobs=1, return_tokens_as_token_ids=True,
                   return_token_ids=True)
    choice = out["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(name.startswith("token_id:")
               for top in choice["logprobs"]["top_logprobs"][1:] for name in top)
    assert choice["text"].startswith(PROMPT)  # the text itself is unchanged
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True,
        **GREEDY}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)


def test_continuous_usage_stats_put_usage_in_every_chunk(http):
    def usages(path: str, body: dict) -> list:
        options = {"include_usage": True, "continuous_usage_stats": True}
        with http.stream("POST", path, json={**body, "max_tokens": 4, "stream": True,
                                             "stream_options": options, **GREEDY}) as r:
            return [(bool(c["choices"]), c.get("usage")) for c in _events(r)]

    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "Hi"}]})):
        every = usages(path, body)
        with_choices = [u for has_choices, u in every if has_choices]
        assert len(with_choices) >= 2 and all(u is not None for u in with_choices)
        counts = [u["completion_tokens"] for u in with_choices]
        assert counts == sorted(counts) and counts[-1] == 4
        prompt_tokens = with_choices[0]["prompt_tokens"]
        assert prompt_tokens > 0 and all(u["prompt_tokens"] == prompt_tokens
                                         for u in with_choices)
        # The final usage chunk: the last counts, and (this stack runs with
        # --enable-prompt-tokens-details) the cached prompt tokens, which only it carries.
        has_choices, final = every[-1]
        last = dict(with_choices[-1])
        assert last.pop("prompt_tokens_details") is None
        assert final.pop("prompt_tokens_details")["cached_tokens"] >= 0
        assert not has_choices and final == last
    assert counts[0] == 0  # chat: the role chunk comes before any token


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http):
    prompt = "One two three four five six seven eight nine ten eleven twelve"
    ids = tokenize(http, prompt)
    assert len(ids) > 6
    out = complete(http, prompt=prompt, truncate_prompt_tokens=4, return_token_ids=True)
    assert out["usage"]["prompt_tokens"] == 4
    assert out["choices"][0]["prompt_token_ids"] == ids[-4:]
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
        "truncate_prompt_tokens": 5}).json()
    assert chat["usage"]["prompt_tokens"] == 5


def test_best_of_returns_the_samples_with_the_highest_logprob(http):
    sampled = {"temperature": 1.0, "seed": 1234, "max_tokens": 4, "logprobs": 0}
    # Seeded, sample j of a request draws the same tokens whatever n is: these are the three
    # candidates best_of=3 chooses from.
    three = complete(http, n=3, **sampled)["choices"]
    candidates = sorted(((sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in three),
                        reverse=True)
    best = complete(http, best_of=3, **sampled)
    assert [c["text"] for c in best["choices"]] == [candidates[0][1]]
    assert best["usage"]["completion_tokens"] == 12  # all three were generated
    best_two = complete(http, best_of=3, n=2, **sampled)["choices"]
    assert [c["index"] for c in best_two] == [0, 1]
    assert [c["text"] for c in best_two] == [t for _, t in candidates[:2]]


def test_user_is_accepted_and_ignored(client):
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, user="someone", **GREEDY)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **GREEDY)
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
    ("completions", {"best_of": 2, "stream": True}, "best_of"),
    ("completions", {"suffix": " and so on"}, "suffix"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("chat", {"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ("completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"priority": 1}, "priority"),
    ("completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
])
def test_bad_values_are_400s_naming_the_field(http, endpoint, body, param):
    path, base = (("/v1/completions", {"prompt": PROMPT}) if endpoint == "completions" else
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}))
    r = http.post(path, json={**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_openai_client_sees_a_refusal_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, suffix="!")
    assert "fill-in-the-middle" in err.value.message


def _events(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])
