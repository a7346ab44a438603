"""The engine's side of a worker's death, in one process: with steps in flight, the worker's KV
cache and its copy of every sequence are lost (here: wiped, the cache filled with noise); after
`recover_from_worker_loss` every request is recomputed and ends exactly as without the fault."""
from collections import deque

import pytest
import torch

from pagoda import LLM, SamplingParams
from proto.codec import decode, encode
from services.engine.sequence import SequenceStatus

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):",
           "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_space_gib=0.1, swap_space=0.05)


def lose_the_worker(engine) -> None:
    """What the death of the worker leaves a new one with: no steps, no sequences, and a KV
    cache of noise, so that reading anything not recomputed changes the output. (Finite noise:
    masked positions are read too, with weight 0.)"""
    executor = engine.executor
    executor._launched.clear()
    executor._finished.clear()
    runner = executor.worker.model_runner
    runner.seqs.clear()
    runner.requests.clear()
    runner.fan_out.clear()
    executor.initialize_cache(*executor.determine_num_available_blocks())
    generator = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.normal_(0.0, 10.0, generator=generator)
        v.normal_(0.0, 10.0, generator=generator)


def run_overlapped(engine, params: SamplingParams, lose_after: int | None = None,
                   tag: str = "run") -> list[list[list[int]]]:
    """The prompts stepped with one step in flight, as the engine service runs them; with
    `lose_after`, the worker dies with two steps in flight after that many submitted steps.
    Returns each request's completions' token ids."""
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS):
        engine.add_request(request_id, prompt, params)
    in_flight = deque()
    outputs: dict[str, list] = {}
    submitted = 0
    while engine.has_unfinished_requests() or in_flight:
        request, sched = engine.schedule_step() if len(in_flight) < 2 else (None, None)
        if request is not None:
            # Through the codec, as the engine service sends it: the request must not share
            # lists (block tables) that scheduling the next step changes.
            engine.executor.submit(decode(encode(request)))
            in_flight.append(sched)
            submitted += 1
            if submitted == lose_after:
                assert len(in_flight) == 2
                in_flight.clear()
                lose_the_worker(engine)
                num_lost = engine.recover_from_worker_loss()
                assert num_lost == engine.get_num_unfinished_requests() > 0
                continue
        if in_flight and (len(in_flight) == 2 or request is None):
            for group in engine.process_model_outputs(in_flight.popleft(),
                                                      engine.executor.collect()):
                outputs[group.request_id] = [list(s.output_token_ids) for s in
                                             sorted(group.seqs, key=lambda s: s.sample_index)]
    return [outputs[rid] for rid in ids]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)],
    ids=["greedy", "n2-seeded"])
def test_requests_lost_mid_decode_are_recomputed_to_the_fault_free_output(llm, params):
    want = run_overlapped(llm.llm_engine, params, tag="clean")
    got = run_overlapped(llm.llm_engine, params, lose_after=6, tag="lost")
    assert got == want


def test_a_fan_out_lost_in_flight_is_forked_again(llm):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    want = run_overlapped(llm.llm_engine, params, tag="clean")
    # The loss comes with the prompt step (whose samples fork the children) still in flight.
    got = run_overlapped(llm.llm_engine, params, lose_after=2, tag="lost")
    assert got == want


def test_a_worker_loss_leaves_no_blocks_no_placeholders_and_waiting_in_arrival_order(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"order-{i}", prompt, params, arrival_time=100.0 + i)
    request, sched = engine.schedule_step()
    engine.executor.submit(decode(encode(request)))
    engine.process_model_outputs(sched, engine.executor.collect())
    request, _ = engine.schedule_step()  # in flight when the worker dies
    engine.executor.submit(decode(encode(request)))
    assert engine.scheduler.block_manager.usage > 0
    lose_the_worker(engine)
    assert engine.recover_from_worker_loss() == len(PROMPTS)
    scheduler = engine.scheduler
    assert not scheduler.running and not scheduler.swapped
    assert [g.request_id for g in scheduler.waiting] == [f"order-{i}" for i in range(len(PROMPTS))]
    assert scheduler.block_manager.usage == 0
    for group in scheduler.waiting:
        assert not group.params_sent
        for seq in group.seqs:
            assert seq.num_placeholders == 0 and seq.num_output_tokens == 1
            assert seq.status == SequenceStatus.WAITING and seq.num_computed_tokens == 0
            assert not seq.worker_synced and not seq.seen_by_worker
    engine.abort_request([f"order-{i}" for i in range(len(PROMPTS))])
    assert not engine.has_unfinished_requests()
