"""LLMEngine on the default model (SmolLM2-135M-Instruct) against transformers: greedy parity in
a batch, under preemption, with prefix caching and with chunked prefill; seeded sampling, stops,
logprobs and abort."""
import pytest
import torch

from pagoda import LLM, SamplingParams

MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at",
    "The three primary colors are",
    "Here is a short list of fruits: apples, bananas, cherries, dates, elderberries, figs, "
    "grapes, and",
    "In 1969, Neil Armstrong became the first person to walk on the Moon. The mission, called "
    "Apollo 11, was launched from Florida and",
    "Q: What is the largest planet in our solar system?\nA:",
    "The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown fox",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide "
    "to make their own food. During this process, oxygen is released as a by-product. Scientists "
    "have studied photosynthesis for centuries, and today we know that it takes place mainly in "
    "the leaves, inside tiny structures called",
]
# Prompts of 3 to 59 tokens; a sequence ends at 83 tokens (6 blocks of 16) at most.
SMALL_CACHE_BLOCKS = 12  # room for 2-3 sequences at a time
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def assert_greedy_parity(outputs, reference, label: str) -> None:
    num_tokens = 0
    for out in outputs:
        expected = reference.greedy(out.prompt_token_ids, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected, f"{label}: {out.prompt!r}"
        num_tokens += len(expected)
    print(f"{label}: {len(outputs)} prompts, {num_tokens} generated tokens equal to "
          f"transformers' greedy generate")


def free_blocks_are_all(engine) -> bool:
    bm = engine.scheduler.block_manager
    return (bm.get_num_free_device_blocks() == bm.num_device_blocks
            and bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks)


# --- greedy parity ---------------------------------------------------------------------------

def test_long_prompts_up_to_500_tokens_in_one_batch_match_transformers(llm, reference, tokenizer):
    text = " ".join(PROMPTS) + " "
    story = tokenizer.encode(text * 6)
    lengths = [17, 64, 129, 200, 288, 350, 431, 500]  # crossing block and chunk boundaries
    prompts = [story[i:i + n] for i, n in enumerate(lengths)]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in outputs] == lengths
    assert_greedy_parity(outputs, reference, "long prompts (17-500 tokens)")
    assert free_blocks_are_all(llm.llm_engine)


def test_a_batch_of_greedy_requests_matches_transformers_token_for_token(llm, reference):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_greedy_parity(outputs, reference, "batch of 10")
    assert free_blocks_are_all(llm.llm_engine)


@pytest.fixture(scope="module", params=["recompute", "swap"])
def small_cache_llm(request):
    return LLM(num_gpu_blocks_override=SMALL_CACHE_BLOCKS, swap_space=0.05,
               preemption_mode=request.param)


def record_steps(monkeypatch, scheduler) -> list:
    """Each step's SchedulerOutputs, with the ids of the requests preempted so far added as
    `preempted` (those swapped out, or back in the waiting queue after running)."""
    steps = []
    schedule = scheduler.schedule

    def recording_schedule():
        metadata, out = schedule()
        out.preempted = {g.request_id for g in scheduler.swapped} | {
            g.request_id for g in scheduler.waiting if g.first_seq.seen_by_worker}
        steps.append(out)
        return metadata, out

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    return steps


def test_preempted_requests_resume_with_identical_output(small_cache_llm, llm, reference,
                                                         monkeypatch):
    engine = small_cache_llm.llm_engine
    mode = engine.config.scheduler_config.preemption_mode
    steps = record_steps(monkeypatch, engine.scheduler)
    # The last two requests, among the victims, also ask for prompt logprobs (which a recompute
    # must not record twice) and for two seeded samples (which must resume as they were).
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1)
    seeded = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=MAX_TOKENS)
    params = [GREEDY] * (len(PROMPTS) - 1) + [with_logprobs, seeded]
    outputs = small_cache_llm.generate(PROMPTS + [PROMPTS[1]], params, use_tqdm=False)
    num_preemptions = engine.get_stats().num_preemptions
    preempted = set().union(*(out.preempted for out in steps))
    print(f"{mode} preemption, {SMALL_CACHE_BLOCKS} blocks: {num_preemptions}, "
          f"requests preempted: {sorted(preempted, key=int)}")
    assert num_preemptions[mode] > 0
    assert {outputs[-2].request_id, outputs[-1].request_id} <= preempted
    assert_greedy_parity(outputs[:-1], reference, f"{mode} preemption")
    assert len(outputs[-2].prompt_logprobs) == len(outputs[-2].prompt_token_ids)
    unpreempted = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0]
    assert ([c.token_ids for c in outputs[-1].outputs]
            == [c.token_ids for c in unpreempted.outputs])
    assert free_blocks_are_all(engine)


def test_prefix_caching_reuses_a_shared_prefix_and_keeps_greedy_output(llm, reference):
    prefix = PROMPTS[-1] + " chloroplasts. "
    prompts = [prefix + q for q in ("What gas is released?", "Where does it happen?",
                                    "Summarise this in one sentence:", "Translate to French:")]
    bm = llm.llm_engine.scheduler.block_manager
    hits_before = bm.num_hit_blocks
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits = bm.num_hit_blocks - hits_before
    print(f"prefix caching: {hits} blocks reused, hit rate {bm.prefix_cache_hit_rate:.2f}")
    assert hits >= 3 * (len(llm.get_tokenizer().encode(prefix)) // 16 - 1)
    assert llm.llm_engine.get_stats().prefix_cache_hit_rate > 0
    assert_greedy_parity(outputs, reference, "prefix caching")


def test_prefix_cache_blocks_are_shared_only_by_requests_with_an_equal_cache_salt(llm, reference):
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    prompt = llm.get_tokenizer().encode(PROMPTS[-1])  # 59 tokens: 3 blocks can be hits
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("salt-empty", None, GREEDY, prompt_token_ids=prompt, cache_salt="")
    hits, outputs = [], []
    for i, salt in enumerate([None, "tenant-a", "tenant-b", "tenant-a"]):
        hits_before = bm.num_hit_blocks
        engine.add_request(f"salt-{i}", None, GREEDY, prompt_token_ids=prompt, cache_salt=salt)
        while engine.has_unfinished_requests():
            outputs += [out for out in engine.step() if out.finished]
        hits.append(bm.num_hit_blocks - hits_before)
    assert hits[1:] == [0, 0, 3]  # the unsalted run (maybe a hit itself) serves neither salt
    # Each output reports its hit in tokens, as vLLM's RequestOutput.num_cached_tokens.
    assert [out.num_cached_tokens for out in outputs[1:]] == [0, 0, 48]
    assert_greedy_parity(outputs, reference, "cache salts")
    assert free_blocks_are_all(engine)


@pytest.fixture(scope="module")
def chunked_llm():
    return LLM(max_num_batched_tokens=32, enable_chunked_prefill=True, kv_cache_space_gib=0.1,
               swap_space=0.05)


def test_chunked_prefill_under_a_small_token_budget_keeps_greedy_output(chunked_llm, reference,
                                                                       monkeypatch):
    steps = record_steps(monkeypatch, chunked_llm.llm_engine.scheduler)
    outputs = chunked_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert max(out.num_batched_tokens for out in steps) <= 32
    assert any(s.is_prompt and s.token_chunk_size > 1 for out in steps
               for s in out.scheduled_seq_groups if not s.do_sample), "no prompt was split"
    assert any(any(s.is_prompt for s in out.scheduled_seq_groups)
               and any(not s.is_prompt for s in out.scheduled_seq_groups) for out in steps)
    assert_greedy_parity(outputs, reference, "chunked prefill, 32-token budget")


def test_prompt_logprobs_of_a_chunked_prompt_cover_every_position(chunked_llm, reference):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    out = chunked_llm.generate(PROMPTS[-1], params, use_tqdm=False)[0]
    assert_prompt_logprobs_match(out, reference, 2)


# --- sampling --------------------------------------------------------------------------------

def test_seeded_parallel_samples_differ_and_repeat_whatever_the_batch(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=16)
    first = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    texts = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(t) for t in texts}) == 3
    again = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == texts
    mates = SamplingParams(temperature=0.8, max_tokens=8)
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]], [mates, params, mates],
                         use_tqdm=False)
    assert [c.token_ids for c in batch[1].outputs] == texts


def test_unseeded_requests_get_different_samples(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12)
    a, b = llm.generate([PROMPTS[1], PROMPTS[1]], params, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_a_stop_string_cuts_the_text_before_it(llm):
    full = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = " ".join(words[3:5])
    assert full.text.count(stop) == 1
    cut = full.text.index(stop)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  stop=[stop, "never appears"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    kept = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:cut + len(stop)]
    assert kept.finish_reason == "stop" and kept.stop_reason == stop


def test_a_stop_token_id_ends_generation_at_its_first_occurrence(llm):
    full = llm.generate(PROMPTS[6], GREEDY, use_tqdm=False)[0].outputs[0]
    position = 6
    stop_id = full.token_ids[position]
    first = full.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[6], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_ends_greedy_generation_and_min_tokens_holds_it_back(llm, tokenizer):
    messages = [{"role": "user", "content": "Say hi."}]
    eos = tokenizer.eos_token_id
    plain = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64),
                     use_tqdm=False)[0].outputs[0]
    assert plain.finish_reason == "stop" and plain.token_ids[-1] == eos
    assert plain.stop_reason is None
    min_tokens = len(plain.token_ids) + 5
    held = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=min_tokens + 20,
                                             min_tokens=min_tokens),
                    use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= min_tokens
    assert eos not in held.token_ids[:min_tokens]
    assert held.token_ids[:len(plain.token_ids) - 1] == plain.token_ids[:-1]


def test_max_tokens_ends_with_finish_reason_length(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None


# --- logprobs --------------------------------------------------------------------------------

def assert_top_logprobs_match(entry: dict[int, float], token: int, expected: torch.Tensor,
                              k: int) -> None:
    """`entry` holds `token` and k alternatives, each with its transformers logprob; the
    alternatives are the k most likely tokens (up to ties within the tolerance)."""
    assert token in entry and len(entry) in (k, k + 1)
    for token_id, logprob in entry.items():
        assert logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
    kth_largest = expected.topk(k).values[-1].item()
    alternatives = sorted(entry.values(), reverse=True)[:k]
    assert min(alternatives) >= kth_largest - 1e-4


def assert_prompt_logprobs_match(out, reference, k: int) -> None:
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    expected = reference.log_softmax(prompt)
    for p in range(1, len(prompt)):
        assert_top_logprobs_match(out.prompt_logprobs[p], prompt[p], expected[p - 1], k)


def test_logprobs_hold_the_sampled_token_and_the_top_k_of_transformers(llm, reference):
    k = 5
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, logprobs=k),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    expected = reference.log_softmax(out.prompt_token_ids + completion.token_ids)
    start = len(out.prompt_token_ids) - 1
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert_top_logprobs_match(entry, token, expected[start + i], k)
    total = sum(entry[t] for t, entry in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_sampled_tokens_logprobs_are_of_the_raw_distribution(llm, reference):
    params = SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=8, logprobs=0)
    out = llm.generate(PROMPTS[4], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    expected = reference.log_softmax(out.prompt_token_ids + completion.token_ids)
    start = len(out.prompt_token_ids) - 1
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert list(entry) == [token]
        assert entry[token] == pytest.approx(expected[start + i, token].item(), abs=1e-4)


def test_prompt_logprobs_match_transformers(llm, reference):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    out = llm.generate(PROMPTS[6], params, use_tqdm=False)[0]
    assert_prompt_logprobs_match(out, reference, 3)


def test_prompt_logprobs_cover_a_prompt_found_in_the_prefix_cache(llm, reference):
    llm.generate(PROMPTS[8], GREEDY, use_tqdm=False)  # caches the prompt's full blocks
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate(PROMPTS[8], params, use_tqdm=False)[0]
    assert_prompt_logprobs_match(out, reference, 1)


# --- abort -----------------------------------------------------------------------------------

def test_abort_mid_generation_frees_every_block_and_the_worker_state(llm):
    engine = llm.llm_engine
    worker_seqs = engine.executor.worker.model_runner.seqs
    params = [SamplingParams(temperature=0.0, max_tokens=200),
              SamplingParams(n=2, temperature=1.0, max_tokens=200)]
    groups = [engine.add_request(f"abort-{i}", PROMPTS[i], p) for i, p in enumerate(params)]
    for _ in range(4):
        engine.step()
    assert all(not g.is_finished() for g in groups) and len(groups[1].seqs) == 2
    assert not free_blocks_are_all(engine)
    seq_ids = [s.seq_id for g in groups for s in g.seqs]
    assert all(i in worker_seqs for i in seq_ids)
    engine.abort_request([g.request_id for g in groups])
    assert not engine.has_unfinished_requests()
    assert free_blocks_are_all(engine)
    assert all(s.status.finish_reason == "abort" for g in groups for s in g.seqs)
    # The engine keeps working, and the worker drops the aborted sequences with the next step.
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert out.finished
    assert not any(i in worker_seqs for i in seq_ids)


def test_a_request_id_reused_while_the_old_requests_last_step_is_in_flight(llm):
    """The engine keeps a step in flight: a request that ends with step N is still in step N+1
    when a new request takes its id. Neither the engine nor the worker may then drop the new
    request's state for the old one's (its sequences would be lost, or the worker would meet
    a request it has no parameters for)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first = engine.add_request("reused", None, params, prompt_token_ids=[1, 2, 3, 4])
    step_n, sched_n = engine.schedule_step()
    step_n1, sched_n1 = engine.schedule_step()  # the old request's placeholder rides along
    engine.process_model_outputs(sched_n, engine.executor.execute_model(step_n))
    assert first.is_finished() and "reused" not in engine.groups
    longer = SamplingParams(temperature=0.0, max_tokens=3)
    second = engine.add_request("reused", None, longer, prompt_token_ids=[5, 6, 7, 8])
    engine.process_model_outputs(sched_n1, engine.executor.execute_model(step_n1))
    assert engine.groups.get("reused") is second
    while engine.has_unfinished_requests():
        engine.step()
    assert len(second.first_seq.output_token_ids) == 3
    assert free_blocks_are_all(engine)
