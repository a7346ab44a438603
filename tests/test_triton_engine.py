"""The whole engine with the Triton attention backend, on the CPU under Triton's interpreter:
greedy tokens identical to the torch backend's on the default model. (On a GPU the same kernels
run compiled; this machine has none.)"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest  # noqa: E402

pytest.importorskip("triton")

from pagoda import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def greedy_tokens(attention_backend: str) -> tuple[list[list[int]], str]:
    # Steps of at most 6 tokens: the prompts (5 and 7 tokens) are prefilled in chunks, the later
    # ones over the cache the earlier ones wrote, beside decodes. 4 tokens each: every step is
    # interpreted Triton (seconds each), and more decodes would only add positions in the same
    # cache block.
    llm = LLM(attention_backend=attention_backend, kv_cache_space_gib=0.05,
              max_num_batched_tokens=6)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    name = llm.llm_engine.executor.worker.model_runner.attn_backend.name
    return [o.outputs[0].token_ids for o in outputs], name


def test_the_triton_backend_gives_the_torch_backends_greedy_tokens():
    want, _ = greedy_tokens("torch")
    got, name = greedy_tokens("triton")
    assert name == "triton"
    assert got == want
