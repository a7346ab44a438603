"""The last layer for the logit rows alone (LlamaModel.forward's `keep_rows`): in a step with
prompt chunks only the rows that get logits go on past the last layer's attention, and they
come out as they would from the whole pass, to the bit, on the panel kernels, in any order asked
and when the last layer is also the first; a decode step in one call returns the rows asked;
quantized weights keep the whole pass; and the engine gives the same tokens and logprobs with
it as without it."""
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda_kernels import cpu as cpu_kernels
from services.worker.models import linear as linear_module
from services.worker.models.llama import LlamaModel
from tests.helpers import PagedBatchPlanner, PagedSequence
from tests.test_layer_blocks import tiny_model, use_panels

if cpu_kernels.load() is None:
    pytest.skip(f"cpu kernels unavailable: {cpu_kernels.unavailable_reason()}",
                allow_module_level=True)


def _caches(model):
    c = model.config
    shape = (64, 16, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    return [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(c.num_hidden_layers)]


def _steps(model, with_prompts: bool):
    """Two sequences' prompts cached, then a step of their decodes, beside two new prompts of
    13 and 21 tokens when `with_prompts` -> (input_ids, positions, caches, meta, the rows that
    sample: the decodes first, then the prompts' last tokens, out of the step's order)."""
    planner = PagedBatchPlanner(64, 16, seed=3)
    caches = _caches(model)
    g = torch.Generator().manual_seed(11)
    running = [PagedSequence(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (9, 4)]
    step = planner.plan_step([(s, len(s.token_ids)) for s in running], [])
    with torch.inference_mode():
        model(step.input_ids, step.positions, caches, step.meta)
    for s in running:
        s.token_ids.append(5)
    if not with_prompts:
        step = planner.plan_step([], running)
        return step.input_ids, step.positions, caches, step.meta, torch.tensor([1, 0])
    prompts = [(PagedSequence(torch.randint(0, 256, (n,), generator=g).tolist()), n)
               for n in (13, 21)]
    step = planner.plan_step(prompts, running)  # prompts' tokens first, then the decodes
    rows = torch.tensor([35, 34, 12, 33])
    return step.input_ids, step.positions, caches, step.meta, rows


def _pass_twice(model, with_prompts: bool = True):
    """The same step whole and with keep_rows, each on fresh copies of the caches."""
    ids, positions, caches, meta, rows = _steps(model, with_prompts)
    with torch.inference_mode():
        whole = model(ids, positions, [(k.clone(), v.clone()) for k, v in caches], meta)
        kept = model(ids, positions, [(k.clone(), v.clone()) for k, v in caches], meta, rows)
    return whole[rows], kept


@pytest.mark.parametrize("num_layers", [2, 1], ids=["2_layers", "1_layer"])
@pytest.mark.parametrize("kind,dtype", [("f32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("mode", ["blocks", "modules"])
def test_kept_rows_are_the_whole_passes_rows_to_the_bit(kind, dtype, mode, num_layers, request):
    model = tiny_model(use_panels(kind, request), dtype, num_layers=num_layers)
    assert model.model.layers[-1].mlp.down_proj.packed.kind == kind
    assert model.model.can_keep_rows
    model.model.use_blocks, model.model.use_decode_step = mode == "blocks", False
    whole, kept = _pass_twice(model)
    assert kept.shape == whole.shape == (4, model.config.hidden_size)
    assert torch.equal(whole, kept)


def test_a_decode_step_in_one_call_returns_the_rows_asked(monkeypatch, request):
    model = tiny_model(use_panels("f32", request), torch.float32)
    calls = []
    decode_layers = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers",
                        lambda *a: calls.append(1) or decode_layers(*a))
    whole, kept = _pass_twice(model, with_prompts=False)
    assert len(calls) == 2  # each decode pass in one call (the prompts before went by layers)
    assert torch.equal(whole, kept)


@pytest.mark.parametrize("kind", ["int8", "Q8_0"])
def test_quantized_last_layers_keep_the_whole_pass(kind):
    # Their kernels pick a path by the rows of x, which a speculative step must keep.
    assert not tiny_model(kind, torch.float32).model.can_keep_rows


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
           "1, 2, 3, 4,"]


def test_the_engine_gives_the_same_tokens_and_logprobs_with_the_last_layer_alone(monkeypatch,
                                                                                 request):
    # On the panels a kept row is the whole pass's to the bit; elsewhere (MKL, oneDNN) the
    # matmul of fewer rows may round differently, so there the logprobs are compared closely.
    panels = cpu_kernels.f32_matmul_available()
    if panels:
        before = linear_module._fp32_layout
        linear_module.set_fp32_layout("panels")
        request.addfinalizer(lambda: linear_module.set_fp32_layout(before))
    llm = LLM(dtype="float32", kv_cache_space_gib=0.25, swap_space=0.05)
    model = llm.llm_engine.executor.worker.model_runner.model.model
    assert model.can_keep_rows
    steps = []  # (tokens in the step, rows kept or None)
    forward = LlamaModel.forward

    def recording(self, input_ids, positions, kv_caches, meta, keep_rows=None):
        steps.append((len(input_ids), None if keep_rows is None else len(keep_rows)))
        return forward(self, input_ids, positions, kv_caches, meta, keep_rows)

    monkeypatch.setattr(LlamaModel, "forward", recording)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def run():
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    kept = run()
    prompt_steps = [s for s in steps if s[0] > len(PROMPTS)]
    assert prompt_steps and all(k == len(PROMPTS) for _, k in prompt_steps), steps
    assert all(k is None for n, k in steps if n == len(PROMPTS))  # decodes: every row
    steps.clear()
    monkeypatch.setattr(LlamaModel, "can_keep_rows", property(lambda self: False))
    whole = run()
    assert all(k is None for _, k in steps)
    assert [tokens for tokens, _ in kept] == [tokens for tokens, _ in whole]
    if panels:
        assert kept == whole
    else:
        for (_, a), (_, b) in zip(kept, whole):
            for step_a, step_b in zip(a, b):
                assert step_a.keys() == step_b.keys()
                assert all(abs(step_a[t].logprob - step_b[t].logprob) < 1e-4 for t in step_a)
