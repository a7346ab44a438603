"""Weight loading: the default GGUF model as transformers reads it, and clear errors."""
import pytest
import torch

from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.model_loader import iter_weights, load_model
from services.worker.models import linear as linear_module
from shared.config import LoadConfig, ModelConfig, load_hf_config
from shared.model_source import ModelSource, resolve_model
from tests.helpers import (PagedBatchPlanner, PagedSequence, model_config_for, new_kv_caches,
                           save_random_model, tiny_llama_config)

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def pagoda_model(default_source):
    """The default model in fp32 with its layer weights kept as parameters ([in, out] copies of
    the same values) rather than packed for oneDNN, which drops them: the first test compares
    them with transformers' weights."""
    hf_config = load_hf_config(default_source)
    model_config = ModelConfig(source=default_source, tokenizer=default_source.path,
                               dtype=torch.float32, seed=0, max_model_len=2048,
                               hf_config=hf_config)
    before = linear_module._fp32_layout
    linear_module.set_fp32_layout("transposed")
    try:
        return load_model(model_config, LoadConfig("auto"), torch.device("cpu"),
                          TorchAttentionBackend())
    finally:
        linear_module.set_fp32_layout(before)


@pytest.fixture(scope="module")
def transformers_model(reference):
    """The default GGUF model as transformers loads it in fp32: the session's reference model
    (tests/conftest.py), loaded once for every module that compares against it."""
    return reference.model


def test_default_gguf_weights_equal_those_transformers_loads(pagoda_model, transformers_model):
    ours = dict(pagoda_model.named_parameters())
    theirs = dict(transformers_model.named_parameters())
    compared = 0
    for name, param in ours.items():
        prefix, module, kind = name.rsplit(".", 2)
        if module in FUSED:
            expected = torch.cat([theirs[f"{prefix}.{part}.{kind}"] for part in FUSED[module]])
        else:
            expected = theirs[name]
        assert torch.equal(param, expected), name
        compared += 1
    # Embedding and final norm, then per layer: 2 norms, qkv, o, gate_up, down (lm_head is tied).
    assert compared == len(ours) == 2 + 30 * 6
    assert pagoda_model.tie_word_embeddings


def test_default_model_logits_match_transformers(pagoda_model, transformers_model):
    prompt = [1, 4093, 28, 1073, 314, 253, 5353, 30, 2, 198, 504, 216]
    planner = PagedBatchPlanner(num_blocks=4, block_size=16)
    caches = new_kv_caches(30, 4, 16, 3, 64)
    step = planner.plan_step([(PagedSequence(prompt), len(prompt))], [])
    logits = pagoda_model.compute_logits(
        pagoda_model(step.input_ids, step.positions, caches, step.meta))
    with torch.no_grad():
        expected = transformers_model(torch.tensor([prompt])).logits[0]
    diff = (logits - expected).abs().max().item()
    print(f"SmolLM2 GGUF, 12-token prompt: max abs logit diff {diff:.2e}")
    assert diff < 1e-3
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_missing_gguf_file_is_a_clear_error(default_source):
    source = ModelSource(default_source.folder, "absent.gguf", "absent")
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        iter_weights(source)


def test_folder_without_safetensors_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        iter_weights(ModelSource(str(tmp_path), None, "empty"))


def test_checkpoint_missing_a_tensor_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file
    hf_config = tiny_llama_config(num_hidden_layers=1)
    save_random_model(hf_config, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*qkv_proj\.weight#1"):
        load_model(model_config_for(tmp_path, hf_config), LoadConfig("auto"),
                   torch.device("cpu"), TorchAttentionBackend())
