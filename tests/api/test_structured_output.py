"""Structured output over HTTP, through the official openai client: OpenAI's response_format,
vLLM's structured_outputs (extra_body), streaming, refusals by name, and logit_bias."""
import json
import re

import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "capital"],
}
MESSAGES = [{"role": "user", "content": "Name a city as JSON: city, and is it a capital?"}]
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "city", "schema": CITY, "strict": True}}


def test_response_format_json_schema_gives_twenty_valid_samples(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=20, temperature=1.0, seed=4, max_tokens=80,
        response_format=JSON_SCHEMA_FORMAT)
    assert len(resp.choices) == 20
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CITY)


def test_structured_outputs_regex_and_choice_through_extra_body(client):
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    completion = client.completions.create(
        model=MODEL, prompt="A name and an age:", max_tokens=12, temperature=1.0, seed=2, n=3,
        extra_body={"structured_outputs": {"regex": regex}})
    for choice in completion.choices:
        assert re.fullmatch(regex, choice.text), choice.text
    choices = ["Paris", "Lyon", "Marseille"]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Which French city is the capital?"}],
        max_tokens=8, temperature=0.0, extra_body={"structured_outputs": {"choice": choices}})
    assert chat.choices[0].message.content in choices


def test_a_streamed_json_schema_response_reassembles_to_valid_json(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=9, max_tokens=80, stream=True,
        response_format=JSON_SCHEMA_FORMAT)
    parts, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    assert len([p for p in parts if p]) > 1  # it did stream
    jsonschema.validate(json.loads("".join(parts)), CITY)


@pytest.mark.parametrize("how, param", [
    ("response_format", "response_format.json_schema.schema"),
    ("structured_outputs", "structured_outputs.json"),
])
def test_an_unsupported_schema_feature_is_a_400_naming_it(client, how, param):
    schema = {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    body = ({"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "tags", "schema": schema}}}
            if how == "response_format" else {"structured_outputs": {"json": schema}})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body=body)
    assert "uniqueItems" in e.value.message and "#/properties/tags" in e.value.message
    assert e.value.body["param"] == param
    # The stack goes on serving.
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_logit_bias_works_over_http(client, tokenizer):
    favoured = tokenizer.encode(" zebra")[0]
    resp = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=3, temperature=0.0,
                                     logit_bias={str(favoured): 100})
    assert resp.choices[0].text == tokenizer.decode([favoured] * 3)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  logit_bias={"not-a-token": 1})
    assert e.value.body["param"] == "logit_bias"
