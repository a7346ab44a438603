"""pagoda's Llama-family model against transformers' implementation with the same weights."""
import types

import pytest
import torch

from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.model_loader import load_model
from services.worker.models.llama import rope_inv_freq
from tests.helpers import (PagedBatchPlanner, PagedSequence, load_config, model_config_for,
                           new_kv_caches, profile_metadata, save_random_model, tiny_llama_config,
                           tiny_qwen2_config)

BLOCK_SIZES = [8, 16, 32]
TOLERANCE = 1e-4
NUM_DECODE_STEPS = 20


class Pair:
    """A transformers model and the same weights loaded into pagoda."""

    def __init__(self, hf_config, folder, dtype=torch.float32):
        self.hf_config = hf_config
        self.hf = save_random_model(hf_config, folder)
        self.model = load_model(model_config_for(folder, hf_config, dtype), load_config(),
                                torch.device("cpu"), TorchAttentionBackend())
        self.head_dim = hf_config.hidden_size // hf_config.num_attention_heads

    def new_cache(self, block_size: int, num_blocks: int = 128, dtype=torch.float32):
        planner = PagedBatchPlanner(num_blocks, block_size, seed=block_size)
        caches = new_kv_caches(self.hf_config.num_hidden_layers, num_blocks, block_size,
                               self.hf_config.num_key_value_heads, self.head_dim, dtype)
        return planner, caches

    def step_logits(self, planner, caches, prefills, decodes) -> torch.Tensor:
        step = planner.plan_step(prefills, decodes)
        hidden = self.model(step.input_ids, step.positions, caches, step.meta)
        return self.model.compute_logits(hidden)

    @torch.no_grad()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([token_ids])).logits[0]  # [len, vocab]


def random_prompts(lengths, vocab, seed=0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Pair(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


def assert_greedy_decoding_matches_generate(pair: Pair, prompts, block_size: int, label: str):
    """Prefill all prompts in one step, decode them together, compare with `generate`."""
    planner, caches = pair.new_cache(block_size)
    seqs = [PagedSequence(list(p)) for p in prompts]
    logits = pair.step_logits(planner, caches, [(s, len(s.token_ids)) for s in seqs], [])
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    step_logits = [logits[ends]]  # [num_seqs, vocab] per step
    for _ in range(NUM_DECODE_STEPS - 1):
        for seq, token in zip(seqs, step_logits[-1].argmax(-1).tolist()):
            seq.token_ids.append(token)
        step_logits.append(pair.step_logits(planner, caches, [], seqs))
    ours = torch.stack(step_logits, dim=1)  # [num_seqs, steps, vocab]
    max_diff = 0.0
    for i, prompt in enumerate(prompts):
        out = pair.hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_DECODE_STEPS,
                               do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
        reference = torch.cat(out.logits)  # [steps, vocab]
        assert ours[i].argmax(-1).tolist() == out.sequences[0, len(prompt):].tolist()
        max_diff = max(max_diff, (ours[i] - reference).abs().max().item())
    print(f"{label}, block {block_size}: greedy tokens equal, max abs logit diff {max_diff:.2e}")
    assert max_diff < TOLERANCE


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_of_prompts_of_different_lengths_matches_transformers(llama, block_size):
    planner, caches = llama.new_cache(block_size)
    prompts = random_prompts([5, 17, 33, 1], vocab=256)
    seqs = [PagedSequence(p) for p in prompts]
    logits = llama.step_logits(planner, caches, [(s, len(s.token_ids)) for s in seqs], [])
    expected = torch.cat([llama.reference_logits(p) for p in prompts])
    diff = (logits - expected).abs().max().item()
    print(f"prefill, block {block_size}: max abs logit diff {diff:.2e}")
    assert diff < TOLERANCE


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_greedy_decoding_through_the_paged_cache_matches_generate(llama, block_size):
    prompts = random_prompts([6, 21, 12, 40], vocab=256, seed=1)
    assert_greedy_decoding_matches_generate(llama, prompts, block_size, "decode")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_chunked_prefill_over_the_cached_prefix_matches_transformers(llama, block_size):
    planner, caches = llama.new_cache(block_size)
    prompt = random_prompts([45], vocab=256, seed=2)[0]
    seq = PagedSequence(prompt)
    chunks = [llama.step_logits(planner, caches, [(seq, n)], []) for n in (13, 19, 13)]
    diff = (torch.cat(chunks) - llama.reference_logits(prompt)).abs().max().item()
    print(f"chunked prefill, block {block_size}: max abs logit diff {diff:.2e}")
    assert diff < TOLERANCE


def test_mixed_step_of_prompts_chunks_and_decodes_matches_transformers(llama):
    planner, caches = llama.new_cache(block_size=16)
    decoding = [PagedSequence(p) for p in random_prompts([9, 26], vocab=256, seed=3)]
    chunked, fresh = (PagedSequence(p) for p in random_prompts([37, 14], vocab=256, seed=4))
    llama.step_logits(planner, caches, [(s, len(s.token_ids)) for s in decoding]
                      + [(chunked, 20)], [])
    for seq, token in zip(decoding, (7, 100)):
        seq.token_ids.append(token)
    logits = llama.step_logits(planner, caches, [(chunked, 17), (fresh, 14)], decoding)
    expected = torch.cat([llama.reference_logits(chunked.token_ids)[20:],
                          llama.reference_logits(fresh.token_ids)]
                         + [llama.reference_logits(s.token_ids)[-1:] for s in decoding])
    diff = (logits - expected).abs().max().item()
    print(f"mixed step: max abs logit diff {diff:.2e}")
    assert diff < TOLERANCE


def test_profile_run_without_a_cache_matches_transformers(llama):
    prompts = random_prompts([8, 3], vocab=256, seed=5)
    input_ids = torch.tensor(prompts[0] + prompts[1])
    positions = torch.tensor(list(range(8)) + list(range(3)))
    hidden = llama.model(input_ids, positions, None, profile_metadata([8, 3]))
    expected = torch.cat([llama.reference_logits(p) for p in prompts])
    assert (llama.model.compute_logits(hidden) - expected).abs().max().item() < TOLERANCE


def test_qwen2_with_qkv_bias_and_tied_embeddings_matches_generate(tmp_path):
    pair = Pair(tiny_qwen2_config(), tmp_path)
    assert pair.model.model.layers[0].self_attn.qkv_proj.bias is not None
    prompts = random_prompts([11, 4, 30], vocab=256, seed=6)
    assert_greedy_decoding_matches_generate(pair, prompts, 16, "qwen2")


def test_llama3_rope_scaling_matches_generate(tmp_path):
    # head_dim 16: wavelengths 6.3 (kept), 32.5 (blended band 16..64) and above 64 (scaled).
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    pair = Pair(tiny_llama_config(rope_parameters=rope, num_hidden_layers=2), tmp_path)
    prompts = random_prompts([50, 7], vocab=256, seed=7)
    assert_greedy_decoding_matches_generate(pair, prompts, 8, "llama3 rope")


def test_rope_settings_are_read_from_legacy_config_fields():
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    legacy = types.SimpleNamespace(rope_theta=500000.0, rope_scaling=scaling)
    current = types.SimpleNamespace(rope_parameters={**scaling, "rope_theta": 500000.0})
    default = types.SimpleNamespace(rope_parameters={"rope_theta": 500000.0})
    assert torch.equal(rope_inv_freq(legacy, 16), rope_inv_freq(current, 16))
    assert not torch.equal(rope_inv_freq(legacy, 16), rope_inv_freq(default, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_agrees_loosely_with_float32(llama, tmp_path, dtype):
    folder = tmp_path / "weights"
    llama.hf.save_pretrained(folder)
    model = load_model(model_config_for(folder, llama.hf_config, dtype), load_config(),
                       torch.device("cpu"), TorchAttentionBackend())
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == dtype
    prompts = random_prompts([24, 9], vocab=256, seed=8)
    seqs32 = [PagedSequence(p) for p in prompts]
    seqs16 = [PagedSequence(p) for p in prompts]
    planner32, caches32 = llama.new_cache(16)
    planner16, caches16 = llama.new_cache(16, dtype=dtype)
    logits32 = llama.step_logits(planner32, caches32, [(s, len(s.token_ids)) for s in seqs32], [])
    step = planner16.plan_step([(s, len(s.token_ids)) for s in seqs16], [])
    logits16 = model.compute_logits(model(step.input_ids, step.positions, caches16, step.meta))
    assert logits16.dtype == dtype
    diff = (logits16.float() - logits32).abs().max().item()
    scale = logits32.abs().max().item()
    print(f"{dtype} vs float32: max abs logit diff {diff:.2e} (largest logit {scale:.2f})")
    assert diff < 0.05 * scale
