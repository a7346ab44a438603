"""Speculative decoding: n-gram proposals verified by the target in one pass, rejection sampling,
lookahead KV slots, acceptance counters, the batch-size switch and the config's checks."""
import pytest
import torch

from services.worker.ngram_proposer import NgramProposer
from services.worker.rejection_sampler import rejection_sample
from services.worker.sampling_metadata import SamplingRow
from shared.config import ConfigError, EngineArgs
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

def test_greedy_output_is_identical_to_plain_greedy(llm, spec_llm):
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    spec = spec_llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for p, s, prompt in zip(plain, spec, PROMPTS):
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
        engine.add_request(f"kv-{i}", prompt, greedy(32))
    while engine.has_unfinished_requests():
        engine.step()
        for group in engine.scheduler.running:
            for seq in group.unfinished_seqs():
                # Exactly the blocks its tokens need: none left over from rejected proposals.
                assert len(bm.get_block_table(seq)) == -(len(seq) // -bm.block_size)
    stats = engine.get_stats().spec_decode
    assert stats.num_draft_tokens - stats.num_accepted_tokens > rejected_before
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


def test_seeded_sampling_with_speculation_is_reproducible(spec_llm):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=16)
    first = spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    drafts_before = spec_llm.llm_engine.get_stats().spec_decode.num_drafts
    again = spec_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert spec_llm.llm_engine.get_stats().spec_decode.num_drafts > drafts_before
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    other = spec_llm.generate(PROMPTS[:2], SamplingParams(temperature=0.8, top_p=0.95, seed=99,
                                                          max_tokens=16), use_tqdm=False)
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


# -- through `pagoda serve` --------------------------------------------------------------------

def test_served_stack_speculates_with_the_same_greedy_text_and_reports_it(llm, tmp_path):
    """The engine service's step loop (no step kept in flight behind a speculative one), the
    official openai client, and the acceptance counters in /metrics."""
    import json
    import re
    import socket

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
        metrics = httpx.get(stack.gateway_url + "/metrics", timeout=30).text
    assert texts == expected

    def value(name: str) -> float:
        found = re.search(rf"^{name}(?:_total)?{{[^}}]*}} (\S+)$", metrics, re.M)
        assert found, f"{name} missing from /metrics"
        return float(found.group(1))
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


def test_draft_model_greedy_output_is_identical_to_plain_greedy(llm, draft_llm):
    plain = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    spec = draft_llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for p, s, prompt in zip(plain, spec, PROMPTS):
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
