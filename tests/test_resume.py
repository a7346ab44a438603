"""Resuming a request on a new engine (`LLMEngine.resume_outputs`): what a gateway sends again
after the engine that ran its requests died. The request comes back with the output its client
already streamed; the new engine recomputes it with the prompt and samples on, and its output is
the output the request would have had without the fault."""
import pytest

from pagoda import SamplingParams
from proto.requests import ResumedOutput

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the largest planet in our solar system?\nA:",
]
MAX_TOKENS = 20


def run(engine, request_id: str, prompt: str, params: SamplingParams,
        resumed: list[ResumedOutput] | None = None):
    group = engine.add_request(request_id, prompt, params)
    if resumed:
        engine.resume_outputs(group, resumed)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    assert final is not None
    return final


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def uninterrupted(llm) -> list:
    """Each prompt's greedy output, run alone and uninterrupted: once for every resume point."""
    return [run(llm.llm_engine, f"plain-{i}", prompt, GREEDY).outputs[0]
            for i, prompt in enumerate(PROMPTS)]


@pytest.mark.parametrize("num_streamed", [1, 7, MAX_TOKENS - 1])
def test_a_resumed_greedy_request_ends_with_the_output_of_an_uninterrupted_one(llm, uninterrupted,
                                                                              num_streamed):
    engine = llm.llm_engine
    for i, (prompt, whole) in enumerate(zip(PROMPTS, uninterrupted)):
        streamed = whole.token_ids[:num_streamed]
        resumed = run(engine, f"resumed-{num_streamed}-{i}", prompt, GREEDY,
                      [ResumedOutput(0, streamed)])
        out = resumed.outputs[0]
        assert out.token_ids == whole.token_ids, (prompt, num_streamed)
        assert out.text == whole.text and out.finish_reason == "length"
        # The resumed tokens are output, not prompt: usage and max_tokens count them.
        assert resumed.prompt_token_ids == llm.get_tokenizer().encode(prompt)


def test_a_resumed_seeded_parallel_request_draws_what_it_would_have_drawn(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, n=3, seed=1234, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    whole = run(engine, "seeded-plain", PROMPTS[1], params)
    by_index = {c.index: c.token_ids for c in whole.outputs}
    assert len({tuple(t) for t in by_index.values()}) > 1, "the samples should differ"
    # Sample 2 had already finished at the client; 0 and 1 were part way (a client holds
    # running samples in step; one ahead of the others is taken back to them).
    resumed = [ResumedOutput(0, by_index[0][:4]), ResumedOutput(1, by_index[1][:9]),
               ResumedOutput(2, by_index[2], finished=True)]
    again = run(engine, "seeded-resumed", PROMPTS[1], params, resumed)
    got = {c.index: c.token_ids for c in again.outputs}
    assert got[0] == by_index[0] and got[1] == by_index[1]
    assert got[2] == by_index[2]  # kept as the client had it, not run again


def test_a_resumed_request_with_logprobs_gives_the_logprobs_of_its_new_tokens(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    whole = run(engine, "lp-plain", PROMPTS[0], params).outputs[0]
    again = run(engine, "lp-resumed", PROMPTS[0], params,
                [ResumedOutput(0, whole.token_ids[:5])]).outputs[0]
    assert again.token_ids == whole.token_ids
    for want, got in zip(whole.logprobs[5:], again.logprobs[5:]):
        assert set(want) == set(got)
        for token, lp in want.items():
            assert got[token] == pytest.approx(lp, abs=1e-3)


@pytest.mark.parametrize("resumed, message", [
    ([ResumedOutput(1, [5])], "sample index 1"),
    ([ResumedOutput(0, [5]), ResumedOutput(0, [6])], "repeated"),
    ([ResumedOutput(0, [10 ** 7])], "out of range"),
    ([ResumedOutput(0, [5] * 8)], "no room to go on"),
    ([ResumedOutput(0, [5, 6], finished=True)], "every sample is finished"),
])
def test_resumed_output_that_does_not_fit_the_request_is_refused(llm, resumed, message):
    engine = llm.llm_engine
    group = engine.add_request(f"bad-{message}", PROMPTS[0],
                               SamplingParams(temperature=0, max_tokens=8))
    try:
        with pytest.raises(ValueError, match=message):
            engine.resume_outputs(group, resumed)
    finally:
        engine.abort_request(group.request_id)
    assert not engine.has_unfinished_requests()
