"""Tensor parallelism over torch.distributed (gloo on the CPU): how the model splits, the
offline engine with two ranks, and `pagoda serve`'s stack with two worker ranks, one of which
is killed mid-run. Greedy outputs must be those of one rank, token for token."""
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest
import torch

from ops.launcher import LocalStack
from shared.config import ConfigError
from shared.tensor_parallel import shard_for
from shared.sampling_params import SamplingParams
from services.worker.models.shard_weights import shard_tensor
from tests.faults.stack_faults import SupervisedStack, free_port

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three laws of robotics are", "In 1492,", "Water boils at",
           "My favourite recipe is", "The quick brown fox"]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def config(heads, kv_heads, intermediate=96, vocab=1000):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads,
                           intermediate_size=intermediate, vocab_size=vocab)


@pytest.mark.parametrize("heads,kv_heads,world", [(9, 3, 2), (9, 3, 3), (8, 8, 3), (8, 2, 4),
                                                  (8, 1, 2), (32, 8, 8), (4, 4, 1)])
def test_every_head_column_and_vocabulary_row_has_one_owner(heads, kv_heads, world):
    c = config(heads, kv_heads)
    shards = [shard_for(c, r, world) for r in range(world)]
    group = heads // kv_heads
    for s in shards:  # a rank's query heads are exactly those of its KV heads
        assert s.num_heads > 0 and s.num_kv_heads > 0
        assert s.heads[0] // group >= s.kv_heads[0] and (s.heads[1] - 1) // group < s.kv_heads[1]
    assert sorted(h for s in shards for h in range(*s.heads)) == list(range(heads))
    if kv_heads >= world:  # split, not replicated
        assert sorted(k for s in shards for k in range(*s.kv_heads)) == list(range(kv_heads))
    assert sorted(i for s in shards for i in range(*s.intermediate)) == list(range(96))
    assert {s.vocab_rows for s in shards} == {-(-1000 // world)}  # equal, for the gather
    assert shards[-1].vocab[1] >= 1000 and shards[0].vocab[0] == 0


@pytest.mark.parametrize("heads,kv_heads,world", [(9, 3, 4), (8, 2, 3), (8, 1, 16)])
def test_a_model_that_cannot_split_is_refused(heads, kv_heads, world):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        for rank in range(world):
            shard_for(config(heads, kv_heads), rank, world)


def test_rank_slices_put_back_together_are_the_checkpoint():
    c, world, head_dim, hidden = config(9, 3, intermediate=10, vocab=11), 2, 4, 6
    shards = [shard_for(c, r, world) for r in range(world)]
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(9 * head_dim, hidden),
               "model.layers.0.self_attn.k_proj.weight": torch.randn(3 * head_dim, hidden),
               "model.layers.0.mlp.up_proj.weight": torch.randn(10, hidden)}
    for name, full in tensors.items():
        parts = [shard_tensor(name, full, s, head_dim) for s in shards]
        assert torch.equal(torch.cat(parts), full), name
    o_proj = torch.randn(hidden, 9 * head_dim)
    parts = [shard_tensor("model.layers.0.self_attn.o_proj.weight", o_proj, s, head_dim)
             for s in shards]
    assert torch.equal(torch.cat(parts, dim=1), o_proj)
    bias = torch.randn(hidden)  # a row-parallel bias is added once, after the sum
    parts = [shard_tensor("model.layers.0.mlp.down_proj.bias", bias, s, head_dim) for s in shards]
    assert torch.equal(sum(parts), bias)
    embed = torch.randn(11, hidden)  # padded to 12 rows, 6 per rank, the padding zero
    parts = [shard_tensor("model.embed_tokens.weight", embed, s, head_dim) for s in shards]
    assert [p.shape[0] for p in parts] == [6, 6]
    assert torch.equal(torch.cat(parts)[:11], embed) and not torch.cat(parts)[11:].any()
    norm = torch.randn(hidden)
    assert shard_tensor("model.norm.weight", norm, shards[1], head_dim) is norm


@pytest.fixture(scope="module")
def one_rank(llm) -> list:
    """Greedy outputs of the prompts on one rank (the session's offline engine)."""
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_offline_engine_on_two_ranks_gives_one_rank_greedy_output(one_rank):
    from pagoda import LLM
    with LLM(tensor_parallel_size=2, kv_cache_space_gib=0.25, swap_space=0.05) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        # Rank 0 holds 2 of SmolLM2's 3 KV heads (and their query heads), rank 1 the third.
        assert llm.llm_engine.executor.worker.shard.num_kv_heads == 2
        followers = llm.llm_engine.executor.followers
    assert got == [o.token_ids for o in one_rank]
    assert [p.poll() for p in followers] == [0]  # close() stopped rank 1's process


@pytest.fixture(scope="module")
def tp_stack():
    run_dir = tempfile.mkdtemp(prefix="ptp-", dir="/tmp")  # ipc paths have a length limit
    stack = SupervisedStack(LocalStack(
        engine_args={"tensor_parallel_size": 2, "kv_cache_space_gib": 0.25,
                     "max_model_len": 2048},
        run_dir=run_dir, port=free_port(), hang_timeout_s=10, max_restarts_per_minute=10,
        env={"PAGODA_LIVENESS_TIMEOUT_S": "4", "PAGODA_STEP_TIMEOUT_S": "6"}))
    stack.start()
    yield stack
    stack.stop()


def complete_all(stack: SupervisedStack) -> list[str]:
    client = openai.OpenAI(base_url=f"{stack.stack.gateway_url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: client.completions.create(
            model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text,
            PROMPTS))


def test_served_on_two_ranks_and_recovered_when_one_is_killed(tp_stack, one_rank):
    expected = [o.text for o in one_rank]
    assert complete_all(tp_stack) == expected
    details = tp_stack.engine_details()
    assert int(details["workers"]) == 2  # both ranks registered with the engine

    # SIGKILL rank 1 while the requests run: rank 0's collectives fail and it exits too;
    # the launcher restarts both, they form the group again, and the engine recomputes.
    pids_before = tp_stack.pids()
    killer = threading.Timer(1.0, tp_stack.kill, args=("worker", 1))
    killer.start()
    started = time.monotonic()
    got = complete_all(tp_stack)
    killer.join()
    assert got == expected, f"after {time.monotonic() - started:.0f} s"
    tp_stack.wait_healthy()
    pids_after = tp_stack.pids()
    assert pids_after["worker-0"] != pids_before["worker-0"]  # the whole group was rebuilt
    assert pids_after["worker-1"] != pids_before["worker-1"]


def test_killing_rank_0_while_idle_rebuilds_the_group(tp_stack, one_rank):
    """The leader dies with no step running: the follower, waiting for its next frame, sees
    the group break and exits; both come back and serve the same text."""
    tp_stack.wait_healthy()
    before = tp_stack.pids()
    tp_stack.kill("worker", 0)
    deadline = time.monotonic() + 60
    while tp_stack.pids()["worker-1"] == before["worker-1"]:  # restarted by the launcher
        assert time.monotonic() < deadline, "rank 1 outlived its leader by 60 s"
        time.sleep(0.5)
    tp_stack.wait_healthy()
    assert complete_all(tp_stack) == [o.text for o in one_rank]
