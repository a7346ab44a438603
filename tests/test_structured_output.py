"""Structured output in the worker (xgrammar), logit_bias and allowed_token_ids, through the
offline `LLM` on the default model: outputs follow their grammar at temperature 1, with n > 1
and across preemption, and what xgrammar cannot honour is refused by name."""
import contextlib
import json
import re

import jsonschema
import pytest
import torch

from pagoda import SamplingParams
from shared.sampling_params import SamplingParamsError
from shared.structured_output import StructuredOutputsParams, check_supported
from services.worker.grammar import GrammarMasker, feed, new_matcher
from services.worker.grammar_compiler import GrammarCompilerPool

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
}
PERSON_PROMPT = [{"role": "user", "content": "Describe a person as JSON: name, age and pets."}]
MAX_TOKENS = 64  # a PERSON object takes about 20-30 tokens


def person_params(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(json=PERSON), **kw)


def assert_valid_people(completions) -> None:
    for c in completions:
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), PERSON)


def test_twenty_seeded_samples_at_temperature_1_follow_the_schema(llm):
    # Two requests of n = 10: 20 constrained rows in one batch, each prompt step fanning out.
    outputs = llm.chat([PERSON_PROMPT] * 2, [person_params(n=10, seed=1), person_params(n=10, seed=2)],
                       use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 20
    assert_valid_people(completions)
    assert len({c.text for c in completions}) > 5  # sampled, not one text repeated


def test_regex_and_choice_outputs_match(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["red", "green", "light blue"]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(**kind))
              for kind in ({"regex": regex}, {"choice": choices}) for t, s in ((0.0, None), (1.0, 3))]
    outputs = llm.generate(["My code is", "My code is", "The sky is", "The sky is"], params,
                           use_tqdm=False)
    for o in outputs[:2]:
        assert re.fullmatch(regex, o.outputs[0].text), o.outputs[0].text
    for o in outputs[2:]:
        assert o.outputs[0].text in choices, o.outputs[0].text
    # Unconstrained rows in the same batch stay as they were.
    mixed = llm.generate(["My code is", "The sky is"],
                         [params[0], SamplingParams(temperature=0.0, max_tokens=8)], use_tqdm=False)
    alone = llm.generate(["The sky is"], SamplingParams(temperature=0.0, max_tokens=8),
                         use_tqdm=False)
    assert mixed[0].outputs[0].text == outputs[0].outputs[0].text
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_rebuilt_matcher_gives_the_live_matchers_masks(llm):
    """A matcher rebuilt from a prefix of the output (as after a reset) masks like the one that
    followed every token; after the grammar ends only stop tokens remain."""
    out = llm.chat(PERSON_PROMPT, person_params(seed=5), use_tqdm=False)[0].outputs[0]
    engine = llm.llm_engine
    compiler = GrammarCompilerPool(engine.model_config)
    grammar = compiler.submit(StructuredOutputsParams(json=PERSON))
    stops = engine.eos_token_ids
    vocab = engine.model_config.vocab_size
    masker = GrammarMasker(vocab, torch.device("cpu"))

    def allowed(matcher) -> torch.Tensor:
        logits = torch.zeros(1, vocab)
        masker.mask(logits, [0], [matcher], [stops])
        return logits[0] > float("-inf")

    live = new_matcher(grammar, stops)
    tokens = list(out.token_ids)
    assert tokens[-1] in stops  # the grammar ended and a stop token followed
    for i, token in enumerate(tokens):
        rebuilt = new_matcher(grammar, stops)
        feed(rebuilt, tokens[:i])
        mask = allowed(live)
        assert torch.equal(mask, allowed(rebuilt)), f"masks differ after {i} tokens"
        assert mask[token], f"token {i} ({token}) was sampled but is masked"
        masker.advance([live], [token])
    assert live.terminated
    assert allowed(live).nonzero().flatten().tolist() == sorted(stops)
    compiler.shutdown()


@contextlib.contextmanager
def only_free_blocks(engine, num_blocks: int):
    """Hold all but `num_blocks` free KV blocks (beyond the watermark) of `engine`, so that a few
    growing sequences must preempt one another, without building an engine with a small cache."""
    manager = engine.scheduler.block_manager
    pool = manager.device_pool
    held = [pool.allocate() for _ in range(pool.num_free - num_blocks - manager.watermark_blocks)]
    try:
        yield
    finally:
        for block in held:
            pool.free(block)


def test_a_preempted_constrained_request_resumes_on_its_grammar(llm):
    engine = llm.llm_engine
    before = engine.get_stats().num_preemptions.get("recompute", 0)
    # Three requests of two samples: each sample wants 4-5 blocks as it grows.
    params = [person_params(n=2, seed=20 + i) for i in range(3)]
    with only_free_blocks(engine, 10):
        outputs = llm.chat([PERSON_PROMPT] * 3, params, use_tqdm=False)
    assert engine.get_stats().num_preemptions["recompute"] > before
    assert_valid_people([c for o in outputs for c in o.outputs])
    # The rebuilt matchers gave the masks the live ones would have: the same tokens as without
    # preemption.
    unpreempted = llm.chat([PERSON_PROMPT] * 3, params, use_tqdm=False)
    assert ([[c.token_ids for c in o.outputs] for o in outputs]
            == [[c.token_ids for c in o.outputs] for o in unpreempted])


def test_logit_bias_and_allowed_token_ids_change_outputs_as_documented(llm):
    tokenizer = llm.get_tokenizer()
    prompt = "The capital of France is"
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    base = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    favoured = tokenizer.encode(" banana")[0]
    assert favoured not in base
    yes, no = tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]
    variants = [
        SamplingParams(temperature=0.0, max_tokens=4, logit_bias={favoured: 100}),
        SamplingParams(temperature=0.0, max_tokens=4, logit_bias={base[0]: -100}),
        SamplingParams(temperature=1.0, seed=7, max_tokens=4, allowed_token_ids=[yes, no]),
        greedy,
    ]
    outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * 4, variants, use_tqdm=False)]
    assert outs[0] == [favoured] * 4
    assert outs[1][0] != base[0]
    assert set(outs[2]) <= {yes, no}
    assert outs[3] == base  # batch mates with edits leave an unedited row alone
    # Clamped to [-100, 100]; ids are checked against the vocabulary.
    assert SamplingParams(logit_bias={1: 1e6}).logit_bias == {1: 100.0}
    vocab = llm.llm_engine.model_config.vocab_size
    for bad in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[vocab])):
        name = next(iter(bad))
        with pytest.raises(SamplingParamsError, match=name) as e:
            llm.generate(prompt, SamplingParams(max_tokens=2, **bad), use_tqdm=False)
        assert e.value.field == name


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}},
     "multipleOf"),
    ({"type": "object", "properties": {"s": {"type": "string", "format": "iri"}}}, "format"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
      "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "contains": {"const": 5}}, "contains"),
])
def test_a_keyword_xgrammar_would_ignore_is_refused_by_name(schema, keyword):
    with pytest.raises(SamplingParamsError, match=f"'{keyword}'") as e:
        check_supported(StructuredOutputsParams(json=schema))
    assert e.value.field == "structured_outputs.json"


def test_a_repeated_grammar_is_checked_once_and_refused_the_same_each_time():
    from shared.structured_output import _grammar_problem
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
              "required": ["when"], "title": "repeated-check"}
    for params in (StructuredOutputsParams(json=schema), StructuredOutputsParams(regex="x(y")):
        before = _grammar_problem.cache_info()
        outcomes = []
        for _ in range(3):
            try:
                check_supported(params)
                outcomes.append(None)
            except SamplingParamsError as e:
                outcomes.append((e.field, str(e)))
        after = _grammar_problem.cache_info()
        assert len(set(outcomes)) == 1
        assert (after.misses - before.misses, after.hits - before.hits) == (1, 2)
    assert outcomes[0][0] == "structured_outputs.regex"


def test_invalid_grammars_are_refused_and_the_engine_keeps_working(llm):
    bad = [({"regex": "a(b"}, "regex"), ({"grammar": 'root ::= "a'}, "EBNF"),
           ({"json": {"type": "wrong"}}, "JSON schema")]
    for kind, what in bad:
        with pytest.raises(SamplingParamsError, match=f"invalid {what}"):
            llm.generate("Hi", SamplingParams(
                max_tokens=2, structured_outputs=StructuredOutputsParams(**kind)), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="uniqueItems"):
        llm.generate("Hi", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
            json={"type": "array", "uniqueItems": True})), use_tqdm=False)
    out = llm.generate("Hi", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json_object=True), temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("{")


def test_min_tokens_past_the_grammars_end_adds_stop_tokens_not_tokens_outside_it(llm):
    """A choice ends after one token; min_tokens=5 cannot mask the stop tokens then (nothing
    would be left to sample): the output stays the choice, with finite logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5, logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(["Is the sky blue? Answer:"], params, use_tqdm=False)[0].outputs[0]
    stops = set(llm.llm_engine.eos_token_ids)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) == 5 and set(out.token_ids[-4:]) <= stops
    assert all(lp[t] == lp[t] for lp, t in zip(out.logprobs, out.token_ids))  # no NaN
