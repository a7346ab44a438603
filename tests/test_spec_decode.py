"""Speculative decoding: n-gram proposals verified by the target in one pass, rejection sampling,
lookahead KV slots, stops inside accepted tokens, aborts, acceptance counters, the batch-size
switch, quantized matmuls on the plain step's path, the draft's bounded catch-up and the
config's checks."""
import argparse
import itertools
import json

import pytest
import torch

from services.worker.ngram_proposer import NgramProposer
from services.worker.rejection_sampler import rejection_sample
from services.worker.sampling_metadata import SamplingRow
from shared.config import ConfigError
from shared.engine_args import EngineArgs
from shared.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "disable_by_batch_size": 12}

# Twelve prompts, most of them text that repeats itself (so proposals are made and some are
# rejected), a few that do not.
PROMPTS = [
    "Repeat this list: apples, pears, plums, apples, pears, plums, apples,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Copy the sentence: the quick brown fox jumps over the lazy dog. Copy: the quick",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
    "Write a haiku about the sea.",
    "<ul><li>one</li><li>two</li><li>three</li><li>",
    "A B C D E F G A B C D E F G A B",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
    "Explain what a hash map is in one sentence.",
    "red green blue red green blue red green",
]


@pytest.fixture(scope="module")
def spec_llm():
    from pagoda import LLM
    llm = LLM(kv_cache_space_gib=0.25, speculative_config=dict(NGRAM))
    yield llm
    llm.close()


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def plain_greedy(llm):
    """The plain engine's greedy output of PROMPTS (both proposers are held to it)."""
    return llm.generate(PROMPTS, greedy(), use_tqdm=False)


_request_ids = itertools.count()


def run_alone(engine, prompt: str, params: SamplingParams, eos_token_ids=None):
    """`prompt` as the only request in `engine` until it finishes -> (its CompletionOutput,
    the tokens the worker emitted for it, step by step)."""
    executor = engine.executor
    real = executor.execute_model
    emitted = []

    def recording(request):
        out = real(request)
        for i in range(len(out.seq_ids)):
            emitted.append([out.token_ids[i]] + (out.extra_token_ids[i] if out.extra_token_ids
                                                 else []))
        return out
    executor.execute_model = recording
    final = None
    try:
        engine.add_request(f"alone-{next(_request_ids)}", prompt, params,
                           eos_token_ids=eos_token_ids)
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.finished), final)
    finally:
        del executor.execute_model  # the class's method again
    return final.outputs[0], emitted


@pytest.fixture(scope="module")
def inside_a_step(spec_llm):
    """A prompt whose greedy output (24 tokens) has a step that emitted 3 tokens or more, and a
    token of that step neither its first nor its last, whose id and text occur there first in
    the output -> (prompt, the output, the token's index in it)."""
    engine = spec_llm.llm_engine
    tokenizer = engine.tokenizer
    for prompt in (PROMPTS[8], PROMPTS[5], PROMPTS[0], PROMPTS[3]):
        out, emitted = run_alone(engine, prompt, greedy(24))
        tokens = out.token_ids
        pos = 0
        for step in emitted:
            for j in range(1, len(step) - 1):
                i = pos + j
                if i >= len(tokens):  # past an EOS: dropped
                    break
                piece = tokenizer.decode([tokens[i]])
                if (tokens.index(tokens[i]) == i and piece.strip()
                        and piece not in tokenizer.decode(tokens[:i])):
                    return prompt, out, i
            pos += len(step)
    raise AssertionError("no step accepted two proposals in a row")


# -- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, says", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "draft model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
    ('{"method": "ngram", ', "JSON"),
])
def test_bad_speculative_config_names_the_field(value, says):
    with pytest.raises(ConfigError) as e:
        EngineArgs(speculative_config=value).create_engine_config()
    assert e.value.field == "speculative_config"
    assert says in str(e.value)


def test_speculative_config_from_json_text_and_tensor_parallel_refused():
    config = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'
                        ).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 3
    assert config.speculative_config.method == "ngram"
    with pytest.raises(ConfigError) as e:
        EngineArgs(speculative_config=dict(NGRAM), tensor_parallel_size=2).create_engine_config()
    assert e.value.field == "speculative_config"


# -- proposer ----------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_suffix_and_nothing_without_a_match():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    assert proposer.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3) == [8, 9, 1]
    assert proposer.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 2) == [8, 9]
    assert proposer.propose([1, 2, 3, 4, 5, 6], 3) == []
    # The longest suffix wins: (3, 4) occurs twice, (2, 3, 4) once, followed by 9.
    assert proposer.propose([2, 3, 4, 9, 3, 4, 7, 2, 3, 4], 1) == [9]


# -- rejection sampler -------------------------------------------------------------------------

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
NUM_DRAWS = 4000
CHI2_LIMIT = 30.0  # p ~ 1e-4 at 5 degrees of freedom, with fixed seeds: it cannot flake


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs / probs.sum() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def rows(params: SamplingParams, n: int) -> list[SamplingRow]:
    return [SamplingRow(params, seed, 0, 0, [], []) for seed in range(n)]


@pytest.mark.parametrize("proposed", [0, 3])
def test_point_mass_proposals_keep_the_target_distribution(proposed):
    """Each emitted token, accepted or drawn after a rejection, follows the target's p: with the
    likeliest token proposed (accepted ~40%) and with an unlikely one (~10%)."""
    logits = PROBS.log().repeat(2 * NUM_DRAWS, 1)  # two positions per sequence
    out = rejection_sample(logits, [[proposed]] * NUM_DRAWS, rows(SamplingParams(), NUM_DRAWS))
    first = torch.tensor([t[0] for t in out.token_ids])
    counts = torch.bincount(first, minlength=6).float()
    assert chi_square(counts, PROBS) < CHI2_LIMIT, counts
    accepted = sum(len(t) == 2 for t in out.token_ids) / NUM_DRAWS
    assert abs(accepted - float(PROBS[proposed])) < 0.03
    # After an acceptance, the bonus token is a draw from the next position's p.
    bonus = torch.tensor([t[1] for t in out.token_ids if len(t) == 2])
    assert chi_square(torch.bincount(bonus, minlength=6).float(), PROBS) < CHI2_LIMIT


def test_draft_distribution_proposals_keep_the_target_distribution():
    """Proposals drawn from a draft q, accepted with min(1, p/q), else the residual."""
    q = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.3, 0.3])
    gen = torch.Generator().manual_seed(0)
    proposals = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=gen).tolist()
    logits = PROBS.log().repeat(2 * NUM_DRAWS, 1)
    out = rejection_sample(logits, [[d] for d in proposals], rows(SamplingParams(), NUM_DRAWS),
                           draft_probs=q.repeat(NUM_DRAWS, 1))
    counts = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=6).float()
    assert chi_square(counts, PROBS) < CHI2_LIMIT, counts
    assert chi_square(counts, q) > 3 * CHI2_LIMIT, counts  # not the draft's distribution


def test_greedy_accepts_while_the_proposal_is_the_argmax_then_takes_the_argmax():
    logits = torch.full((4, 6), -5.0)
    for pos, best in enumerate([2, 3, 1, 4]):
        logits[pos, best] = 5.0
    params = SamplingParams(temperature=0)
    out = rejection_sample(logits, [[2, 3, 5]], rows(params, 1))
    assert out.token_ids == [[2, 3, 1]]
    out = rejection_sample(logits, [[2, 3, 1]], rows(params, 1))
    assert out.token_ids == [[2, 3, 1, 4]]  # all accepted: the bonus token too
    lp = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0] == pytest.approx([float(lp[0, 2]), float(lp[1, 3]),
                                             float(lp[2, 1]), float(lp[3, 4])], abs=1e-5)


def test_seeded_verification_is_reproducible_and_seeds_differ():
    logits = PROBS.log().repeat(5 * 64, 1)
    params = SamplingParams(temperature=1.0, seed=7)
    a = rejection_sample(logits, [[0, 0, 1, 0]] * 64, rows(params, 64))
    b = rejection_sample(logits, [[0, 0, 1, 0]] * 64, rows(params, 64))
    assert a.token_ids == b.token_ids
    assert len({tuple(t) for t in a.token_ids}) > 1  # rows of different seeds differ


# -- end to end (offline LLM) ------------------------------------------------------------------

def test_greedy_output_is_identical_to_plain_greedy(plain_greedy, spec_llm):
    spec = spec_llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for p, s, prompt in zip(plain_greedy, spec, PROMPTS):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids, prompt
        assert s.outputs[0].text == p.outputs[0].text
        assert s.outputs[0].finish_reason == p.outputs[0].finish_reason
    stats = spec_llm.llm_engine.get_stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    # Some proposals were rejected too, so the lookahead slots were released and reused.
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    bm = spec_llm.llm_engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


def test_lookahead_blocks_of_rejected_proposals_are_freed_every_step(spec_llm):
    engine = spec_llm.llm_engine
    bm = engine.scheduler.block_manager
    stats = engine.get_stats().spec_decode
    rejected_before = stats.num_draft_tokens - stats.num_accepted_tokens
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"kv-{i}", prompt, greedy(20))
    while engine.has_unfinished_requests():
        engine.step()
        for group in engine.scheduler.running:
            for seq in group.unfinished_seqs():
                # Exactly the blocks its tokens need: none left over from rejected proposals.
                assert len(bm.get_block_table(seq)) == -(len(seq) // -bm.block_size)
    stats = engine.get_stats().spec_decode
    assert stats.num_draft_tokens - stats.num_accepted_tokens > rejected_before
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


@pytest.mark.parametrize("stop", ["stop_token_ids", "eos", "stop string"])
def test_a_stop_inside_accepted_proposals_ends_the_output_there(llm, spec_llm, inside_a_step,
                                                                 stop):
    """The worker emits the accepted proposals after the stop too; the engine drops them and
    finishes as plain decoding does."""
    engine = spec_llm.llm_engine
    prompt, base, i = inside_a_step
    token, eos, extra = base.token_ids[i], None, {}
    if stop == "stop_token_ids":
        extra = {"stop_token_ids": [token]}
    elif stop == "eos":
        eos = [token]
    else:  # the token's text, which occurs there first
        extra = {"stop": [engine.tokenizer.decode([token])]}
    params = SamplingParams(temperature=0, max_tokens=24, **extra)
    out, emitted = run_alone(engine, prompt, params, eos)
    plain, _ = run_alone(llm.llm_engine, prompt, params, eos)
    assert out.token_ids == plain.token_ids == base.token_ids[:i + 1]
    assert out.text == plain.text
    assert out.finish_reason == plain.finish_reason == "stop"
    assert out.stop_reason == plain.stop_reason
    emitted_tokens = [t for step in emitted for t in step]
    assert len(emitted_tokens) > i + 1  # the step went on past the stop: those were dropped
    assert emitted_tokens[:i + 1] == out.token_ids


def test_max_tokens_inside_a_step_cuts_the_proposals(spec_llm, inside_a_step):
    """Lookahead is cut to what max_tokens leaves: the output ends exactly there, and the
    worker computed nothing past it."""
    engine = spec_llm.llm_engine
    prompt, base, i = inside_a_step
    out, emitted = run_alone(engine, prompt, greedy(i + 1))
    assert out.token_ids == base.token_ids[:i + 1]
    assert out.finish_reason == "length"
    assert sum(len(step) for step in emitted) == i + 1
    assert any(len(step) > 1 for step in emitted)  # and it did speculate


def test_an_abort_while_a_speculative_step_is_in_flight_frees_every_block(spec_llm):
    engine = spec_llm.llm_engine
    bm = engine.scheduler.block_manager
    groups = [engine.add_request(f"abort-{i}", p, greedy(32)) for i, p in
              enumerate(PROMPTS[:3])]
    for _ in range(40):
        request, sched = engine.schedule_step()
        if request is not None and request.num_lookahead_slots:
            break
        engine.process_model_outputs(sched, engine.executor.execute_model(request))
    else:
        raise AssertionError("nothing speculated")
    engine.abort_request([g.request_id for g in groups])  # lookahead slots still held
    engine.process_model_outputs(sched, engine.executor.execute_model(request))
    assert not engine.has_unfinished_requests()
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    # The next step tells the worker to drop them; the engine goes on as before.
    spec_llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)
    held = engine.executor.worker.model_runner.seqs
    assert not any(g.first_seq.seq_id in held for g in groups)
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


def test_seeded_sampling_with_speculation_is_reproducible(spec_llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=12)
    first = spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    drafts_before = spec_llm.llm_engine.get_stats().spec_decode.num_drafts
    again = spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert spec_llm.llm_engine.get_stats().spec_decode.num_drafts > drafts_before
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    other = spec_llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, top_p=0.95, seed=99,
                                                          max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in other] != [o.outputs[0].token_ids for o in first]


def test_acceptance_counters_and_speculation_off_above_the_batch_size(spec_llm):
    engine = spec_llm.llm_engine
    stats = engine.get_stats().spec_decode
    assert len(stats.accepted_per_pos) == NGRAM["num_speculative_tokens"]
    # Position j is accepted only where every position before it was.
    assert all(a >= b for a, b in zip(stats.accepted_per_pos, stats.accepted_per_pos[1:]))
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert 1.0 < stats.mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]
    spec = engine.scheduler.speculative_config
    before_drafts, before_off = stats.num_drafts, engine.get_stats().spec_decode.num_steps_off
    spec.disable_by_batch_size = 2  # the scheduler reads it every step
    try:
        # Four sequences decode in every step (same length, no EOS): none may speculate.
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        spec_llm.generate(PROMPTS[:4], params, use_tqdm=False)
        stats = engine.get_stats().spec_decode
        assert stats.num_drafts == before_drafts
        assert stats.num_steps_off >= 10
        spec_llm.generate(PROMPTS[:1], params, use_tqdm=False)  # one: it speculates again
        assert engine.get_stats().spec_decode.num_drafts > before_drafts
        assert engine.get_stats().spec_decode.num_steps_off == stats.num_steps_off
    finally:
        spec.disable_by_batch_size = NGRAM["disable_by_batch_size"]
    assert before_off <= stats.num_steps_off


def test_requests_that_need_per_position_logits_do_not_speculate(spec_llm):
    engine = spec_llm.llm_engine
    before = engine.get_stats().spec_decode.num_drafts
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, repetition_penalty=1.0)
    out = spec_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert len(out[0].outputs[0].logprobs) == len(out[0].outputs[0].token_ids)
    spec_llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16,
                                                  presence_penalty=0.5), use_tqdm=False)
    assert engine.get_stats().spec_decode.num_drafts == before


def test_bench_spec_on_loaded_engines_reports_rates_the_ratio_and_acceptance(
        llm, spec_llm, tmp_path, capsys):
    """`pagoda bench spec`'s measurement, one round of one prompt, on the loaded engines."""
    from ops.bench import spec
    out = tmp_path / "spec.json"
    args = argparse.Namespace(rounds=1, num_prompts=1, output_len=12, output_json=str(out))
    result = spec.measure({"plain": llm, "speculative": spec_llm}, args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["same_tokens"] is True
    assert all(len(v) == 1 and v[0] > 0 for v in result["output_tok_s"].values())
    assert result["ratio_of_medians"] == (result["median_output_tok_s"]["speculative"]
                                          / result["median_output_tok_s"]["plain"])
    # The rewrite prompt repeats code from the prompt: lookup finds it and some is accepted.
    assert result["acceptance_rate"] > 0 and result["mean_accepted_length"] > 1
    assert result["speculative_config"]["num_speculative_tokens"] == 4
    printed = capsys.readouterr().out
    assert "ratio" in printed and "acceptance rate" in printed


# -- quantized matmuls in a verifying step ----------------------------------------------------

@pytest.mark.parametrize("kind", ["gguf", "int8"])
def test_quantized_matmul_rows_of_a_verifying_step_are_the_plain_steps(kind):
    """Sequences verifying 4 proposals each: 5 rows a sequence, past the row count where the
    matmul changes kernel (int8: 16, GGUF: KERNEL_MAX_ROWS) while the plain step, a row a
    sequence, stays under it. Told so, each sequence's row comes out as in the plain step."""
    from pagoda_kernels import cpu as cpu_kernels
    from services.worker.models.gguf_weights import (KERNEL_MAX_ROWS, Q8_0, GGUFWeight,
                                                     allocate_part, fill_from_float)
    from services.worker.models.linear import PackedWeight, linear, pack_weight
    from services.worker.models.plain_rows import plain_step_rows
    seqs = KERNEL_MAX_ROWS[torch.bfloat16] // 4 if kind == "gguf" else 4
    x = torch.randn(5 * seqs, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    if not cpu_kernels.available_for(x):
        pytest.skip(f"no CPU kernels here: {cpu_kernels.unavailable_reason()}")
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) / 8
    if kind == "gguf":
        part = allocate_part(Q8_0, 0, 96, 128)
        fill_from_float(part, 0, w)
        packed = PackedWeight("gguf", torch.empty(0), 96, gguf=GGUFWeight(128, [part]))
    else:
        packed = pack_weight(w, quantization="int8")
    plain = linear(x[::5].contiguous(), w, None, packed)  # one row per sequence
    with plain_step_rows(seqs):
        verifying = linear(x, w, None, packed)
    assert torch.equal(verifying[::5], plain)
    if kind == "gguf":  # untold, the rows take the dequantized weight: other roundings
        assert not torch.equal(linear(x, w, None, packed)[::5], plain)


# -- through `pagoda serve` --------------------------------------------------------------------

def test_served_stack_speculates_with_the_same_greedy_text_and_reports_it(llm, tmp_path):
    """The engine service's step loop (no step kept in flight behind a speculative one), the
    official openai client, and the acceptance counters in /metrics."""
    import json
    import re
    import socket
    import time

    import httpx
    import openai

    from ops.launcher import LocalStack
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine_args = {"kv_cache_space_gib": 0.25, "max_model_len": 1024,
                   "speculative_config": json.dumps(NGRAM)}
    prompts = PROMPTS[:2]
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
    with LocalStack(engine_args=engine_args, run_dir=str(tmp_path / "run"), port=port) as stack:
        client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="none",
                               max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        texts = [client.completions.create(model=model, prompt=p, max_tokens=16,
                                           temperature=0).choices[0].text for p in prompts]

        def value(name: str) -> float:
            found = re.search(rf"^{name}(?:_total)?{{[^}}]*}} (\S+)$", metrics, re.M)
            assert found, f"{name} missing from /metrics"
            return float(found.group(1))
        # The gateway reuses a probe of the engine's health for up to a second
        # (services/gateway/stack_health.py): two short requests can finish within it.
        deadline = time.monotonic() + 10
        while True:
            metrics = httpx.get(stack.gateway_url + "/metrics", timeout=30).text
            if value("vllm:spec_decode_num_drafts") > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
    assert texts == expected
    assert value("vllm:spec_decode_num_drafts") > 0
    assert 0 < value("vllm:spec_decode_num_accepted_tokens") <= value(
        "vllm:spec_decode_num_draft_tokens")
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in metrics


# -- draft model -------------------------------------------------------------------------------

DRAFT_LAYERS = 8


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory, reference, tokenizer):
    """The default model's first DRAFT_LAYERS layers (its embedding, final norm and head kept)
    as a Hugging Face folder with the same tokenizer: a smaller model of the same vocabulary.
    Built from the session's transformers copy of the model (conftest's `reference`)."""
    import copy

    from transformers import AutoModelForCausalLM
    full = reference.model
    config = copy.deepcopy(full.config)
    config.num_hidden_layers = DRAFT_LAYERS
    if hasattr(config, "quantization_config"):  # loaded from GGUF; the copy is plain weights
        del config.quantization_config
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = draft.load_state_dict(full.state_dict(), strict=False)
    assert not missing
    folder = tmp_path_factory.mktemp("draft")
    draft.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def draft_llm(draft_folder):
    from pagoda import LLM
    llm = LLM(kv_cache_space_gib=0.25, speculative_config={
        "model": draft_folder, "num_speculative_tokens": 3, "disable_by_batch_size": 12})
    yield llm
    llm.close()


def test_draft_model_greedy_output_is_identical_to_plain_greedy(plain_greedy, draft_llm):
    spec = draft_llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for p, s, prompt in zip(plain_greedy, spec, PROMPTS):
        assert s.outputs[0].token_ids == p.outputs[0].token_ids, prompt
    engine = draft_llm.llm_engine
    stats = engine.get_stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    # Each block has a slot in both caches: the draft's is sized like the target's.
    worker = engine.executor.worker
    assert worker.draft_cache_engine.device_cache[0][0].shape[0] == bm.num_device_blocks
    assert len(worker.draft_cache_engine.device_cache) == DRAFT_LAYERS


class _CountingModel:
    """A model that notes how many tokens each forward pass computes."""

    def __init__(self, model):
        self.model, self.passes = model, []

    def __call__(self, input_ids, *args):
        self.passes.append(len(input_ids))
        return self.model(input_ids, *args)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_the_draft_catches_up_in_chunks_within_its_budget(plain_greedy, draft_llm):
    """With a catch-up budget far below the prompt, the draft computes the prompt over several
    steps (no pass above the budget), which decode without proposals until it has caught up;
    greedy output stays plain greedy output."""
    engine = draft_llm.llm_engine
    draft = engine.executor.worker.model_runner.draft
    budget, before = draft.max_batch_tokens, draft.model
    draft.max_batch_tokens = 8
    draft.model = counting = _CountingModel(before)
    try:
        out, emitted = run_alone(engine, PROMPTS[1], greedy())
    finally:
        draft.max_batch_tokens, draft.model = budget, before
    assert out.token_ids == plain_greedy[1].outputs[0].token_ids
    prompt_len = len(engine.tokenizer.encode(PROMPTS[1]))
    assert max(counting.passes) <= 8
    assert sum(counting.passes) >= prompt_len
    # 8 tokens a step against a lag that grows by one: the prompt's step and the decode steps
    # before the draft has caught up emit one token each; later ones speculate again.
    catch_up_steps = prompt_len // 8
    assert all(len(step) == 1 for step in emitted[:catch_up_steps])
    assert any(len(step) > 1 for step in emitted[catch_up_steps:])


def test_draft_model_seeded_sampling_is_reproducible(draft_llm):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12)
    drafts_before = draft_llm.llm_engine.get_stats().spec_decode.num_drafts
    first = draft_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    again = draft_llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert draft_llm.llm_engine.get_stats().spec_decode.num_drafts > drafts_before
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    from tests.helpers import tiny_llama_config
    tiny_llama_config().save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        EngineArgs(speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2}
                   ).create_engine_config()
    assert e.value.field == "speculative_config" and "vocabulary" in str(e.value)
