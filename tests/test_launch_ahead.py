"""Steps launched before the previous one is finished (ModelRunner.launch / finish): a decode's
input token still on the device is gathered there, and an engine that keeps a step in flight
over the in-process executor (which launches each step as it is submitted) gives what the
synchronous engine gives, token for token (logprobs to float rounding). The CPU stands in for the
device here: the sampled-token tensors stay tensors until `finish`, as they stay on a GPU."""
from collections import deque
from types import SimpleNamespace

import torch

from pagoda import SamplingParams
from proto.codec import decode, encode
from proto.messages import PLACEHOLDER
from services.worker.staging import StagingBuffer
from services.worker.step_inputs import prepare_inputs

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The best way to learn"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=3),
    SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=5, top_k=20, top_p=0.9, max_tokens=9, min_tokens=4),
    # Penalties read the sampled tokens on the host: the steps it is in wait for the one
    # before (the whole step: it is short, so that the others go ahead after it).
    SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=3, ignore_eos=True),
]


def _row(token_ids, start, num_tokens, block_table, pending=None):
    state = SimpleNamespace(token_ids=token_ids, block_table=block_table,
                            pending_tokens=pending or {})
    return SimpleNamespace(start=start, num_tokens=num_tokens, state=state,
                           seq=SimpleNamespace(seq_id=id(state)))


def test_a_decode_token_still_on_the_device_is_gathered_into_the_inputs():
    """Pure input preparation, no model: rows 0 and 2 decode a token that two different launched
    steps sampled (rows 3 and 0 of their sampled-token tensors), row 1 a known token."""
    step_a = torch.tensor([11, 12, 13, 14])
    step_b = torch.tensor([21, 22])
    rows = [
        _row([1, 2, 3, 4, 5, PLACEHOLDER], 5, 1, [0], {5: (step_a, 3)}),
        _row([6, 7, 8], 2, 1, [1]),
        _row([9, 9, PLACEHOLDER], 2, 1, [2], {2: (step_b, 0)}),
    ]
    input_ids, positions, meta, _ = prepare_inputs(rows, block_size=16, staging=None)
    assert input_ids.tolist() == [14, 8, 21]
    assert positions.tolist() == [5, 2, 2]
    assert meta.slot_mapping.tolist() == [5, 16 + 2, 32 + 2]


def test_a_prompt_chunk_with_an_unknown_token_is_refused():
    rows = [_row([1, 2, PLACEHOLDER, 4], 0, 4, [0])]
    try:
        prepare_inputs(rows, block_size=16, staging=None)
    except AssertionError as e:
        assert "unknown tokens" in str(e)
    else:
        raise AssertionError("a chunk holding a PLACEHOLDER was prepared")


def _outputs(groups) -> dict[str, list]:
    return {g.request_id: [(list(s.output_token_ids), s.output_logprobs)
                           for s in sorted(g.seqs, key=lambda s: s.sample_index)]
            for g in groups}


def _add(engine, tag: str) -> None:
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"{tag}-{i}", prompt, params)


def test_steps_launched_ahead_give_the_synchronous_engines_tokens(llm):
    engine = llm.llm_engine
    executor = engine.executor
    worker = executor.worker

    _add(engine, "sync")
    finished = []
    while engine.has_unfinished_requests():
        request, sched = engine.schedule_step()
        finished += engine.process_model_outputs(sched, executor.execute_model(request))
    want = {rid.removeprefix("sync-"): out for rid, out in _outputs(
        g for g in finished if g.is_finished()).items()}

    # One step in flight, as the engine service keeps it; count the launches that found an
    # earlier step unfinished, and those among them that gathered a token from the device.
    ahead = {"launches": 0, "with_pending": 0}
    launch = worker.launch

    def counting(request):
        if executor._launched:
            ahead["launches"] += 1
            ahead["with_pending"] += any(s.pending_tokens
                                         for s in worker.model_runner.seqs.values())
        return launch(request)

    worker.launch = counting
    # And every input through a staging buffer, as on a GPU: token ids, the gathers and the
    # sampling parameters in one buffer (on the CPU the buffer is the device's too).
    worker.model_runner.staging = StagingBuffer(torch.device("cpu"))
    try:
        _add(engine, "ahead")
        in_flight, finished = deque(), []
        while engine.has_unfinished_requests() or in_flight:
            request, sched = engine.schedule_step() if len(in_flight) < 2 else (None, None)
            if request is not None:
                executor.submit(decode(encode(request)))  # as the engine service sends it
                in_flight.append(sched)
            if in_flight and (len(in_flight) == 2 or request is None):
                finished += engine.process_model_outputs(in_flight.popleft(), executor.collect())
    finally:
        del worker.launch  # the instance's method again
        worker.model_runner.staging = None
    got = {rid.removeprefix("ahead-"): out for rid, out in _outputs(
        g for g in finished if g.is_finished()).items()}
    # The same tokens; logprobs up to the summation order of batches of other sizes (a step
    # in flight schedules sequences that end with the step before it).
    assert {k: [tokens for tokens, _ in v] for k, v in got.items()} == {
        k: [tokens for tokens, _ in v] for k, v in want.items()}
    for k, samples in want.items():
        for (_, want_lps), (_, got_lps) in zip(samples, got[k]):
            assert len(want_lps) == len(got_lps)
            for w, g in zip(want_lps, got_lps):
                assert w.keys() == g.keys() and all(abs(w[t] - g[t]) < 1e-4 for t in w)
    assert ahead["with_pending"] > 5, ahead
    # Every sample went back into its sequence: nothing is left pending.
    assert not any(s.pending_tokens or PLACEHOLDER in s.token_ids
                   for s in worker.model_runner.seqs.values())


def test_a_penalised_or_re_sent_sequence_waits_for_its_pending_sample(llm):
    """can_launch_ahead, on requests as the engine schedules them after a launched step."""
    engine = llm.llm_engine
    executor = engine.executor
    runner = executor.worker.model_runner
    for tag, params, expect in (
            ("plain", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), True),
            ("penalised", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                         presence_penalty=0.5), False)):
        engine.add_request(tag, PROMPTS[0], params)
        first, sched_first = engine.schedule_step()  # the prompt
        executor.submit(first)
        second, sched_second = engine.schedule_step()  # its first decode, behind it
        assert any(s.pending_tokens for s in runner.seqs.values())
        assert runner.can_launch_ahead(second) is expect
        executor.submit(second)
        engine.process_model_outputs(sched_first, executor.collect())
        engine.process_model_outputs(sched_second, executor.collect())
        while engine.has_unfinished_requests():
            engine.step()
    # A sequence re-sent from its tokens (recompute after preemption) never goes ahead.
    resent = SimpleNamespace(seq_group_metadata_list=[SimpleNamespace(seq_data=[
        SimpleNamespace(seq_id=-1, reset=True, parent_seq_id=-1)])])
    assert not runner.can_launch_ahead(resent)


def test_the_offline_llm_with_async_scheduling_keeps_a_step_in_flight_and_gives_the_same_text(
        llm):
    """`--async-scheduling` (on by default for CUDA only): LLM.generate schedules step N+1 while
    N runs, and the worker launches it ahead; the outputs are the synchronous ones."""
    prompts = PROMPTS[:4]
    params = [SamplingParams(temperature=0, max_tokens=10, stop=["\n\n"]),
              SamplingParams(temperature=0.8, seed=11, max_tokens=8),
              SamplingParams(n=2, temperature=0.9, seed=2, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    engine = llm.llm_engine
    scheduler_config = engine.config.scheduler_config
    assert scheduler_config.async_scheduling is False  # the CPU's default
    want = llm.generate(prompts, params, use_tqdm=False)
    worker = engine.executor.worker
    launch, ahead = worker.launch, []

    def counting(request):
        ahead.append(bool(engine.executor._launched))
        return launch(request)

    worker.launch = counting
    scheduler_config.async_scheduling = True
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        scheduler_config.async_scheduling = False
        del worker.launch
    assert [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in got] == [
        [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in want]
    assert sum(ahead) > 3, ahead
    assert not engine.has_steps_in_flight() and not engine.has_unfinished_requests()

