"""The last layer for the logit rows alone (LlamaModel.forward's `keep_rows`): in a step with
prompt chunks only the rows that get logits go on past the last layer's attention, and they
come out as they would from the whole pass, to the bit, on the float kernels the CPU runs;
quantized weights and tensor parallelism keep the whole pass; and the engine gives the same
tokens and logprobs with it as without it."""
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda_kernels import cpu as cpu_kernels
from services.worker.models.llama import LlamaModel
from tests.helpers import PagedBatchPlanner, PagedSequence
from tests.test_layer_blocks import tiny_model, use_panels

if cpu_kernels.load() is None:
    pytest.skip(f"cpu kernels unavailable: {cpu_kernels.unavailable_reason()}",
                allow_module_level=True)


def _prefill_with_decodes(model):
    """A step of two prompts beside two decodes (the decodes' earlier tokens cached first) ->
    (input_ids, positions, caches, meta, the rows that sample)."""
    c = model.config
    planner = PagedBatchPlanner(64, 16, seed=3)
    shape = (64, 16, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
    caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
              for _ in range(c.num_hidden_layers)]
    g = torch.Generator().manual_seed(11)
    running = [PagedSequence(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (9, 4)]
    step = planner.plan_step([(s, len(s.token_ids)) for s in running], [])
    with torch.inference_mode():
        model(step.input_ids, step.positions, caches, step.meta)
    for s in running:
        s.token_ids.append(5)
    prompts = [(PagedSequence(torch.randint(0, 256, (n,), generator=g).tolist()), n)
               for n in (13, 21)]
    step = planner.plan_step(prompts, running)
    ends = torch.tensor([13, 21]).cumsum(0) - 1
    rows = torch.cat([ends, torch.arange(34, 34 + len(running))])
    return step.input_ids, step.positions, caches, step.meta, rows


def _pass_twice(model, mode):
    """The same step whole and with keep_rows, each on fresh copies of the caches."""
    m = model.model
    m.use_blocks, m.use_decode_step = mode == "blocks", False
    ids, positions, caches, meta, rows = _prefill_with_decodes(model)
    with torch.inference_mode():
        whole = model(ids, positions, [(k.clone(), v.clone()) for k, v in caches], meta)
        kept = model(ids, positions, [(k.clone(), v.clone()) for k, v in caches], meta, rows)
    return whole[rows], kept


@pytest.mark.parametrize("kind,dtype", [("f32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("mode", ["blocks", "modules"])
def test_kept_rows_are_the_whole_passes_rows_to_the_bit(kind, dtype, mode, request):
    model = tiny_model(use_panels(kind, request), dtype)
    assert model.model.layers[-1].mlp.down_proj.packed.kind == kind
    assert model.model.prunes_last_layer
    whole, kept = _pass_twice(model, mode)
    assert kept.shape == whole.shape == (4, model.config.hidden_size)
    assert torch.equal(whole, kept)


@pytest.mark.parametrize("kind", ["int8", "Q8_0"])
def test_quantized_last_layers_keep_the_whole_pass(kind):
    # Their kernels pick a path by the rows of x: fewer rows could round a kept row otherwise.
    assert not tiny_model(kind, torch.float32).model.prunes_last_layer


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
           "1, 2, 3, 4,"]


def test_the_engine_gives_the_same_tokens_and_logprobs_with_the_last_layer_pruned(monkeypatch):
    llm = LLM(dtype="float32", kv_cache_space_gib=0.25, swap_space=0.05)
    model = llm.llm_engine.executor.worker.model_runner.model.model
    assert model.prunes_last_layer
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

    pruned = run()
    prompt_steps = [s for s in steps if s[0] > len(PROMPTS)]
    assert prompt_steps and all(kept == len(PROMPTS) for _, kept in prompt_steps), steps
    assert all(kept is None for n, kept in steps if n == len(PROMPTS))  # decodes: every row
    steps.clear()
    monkeypatch.setattr(LlamaModel, "prunes_last_layer", property(lambda self: False))
    whole = run()
    assert all(kept is None for _, kept in steps)
    assert pruned == whole
