"""The model with its RMSNorm and rotary on the Triton kernels (as on CUDA) against the model on
its torch code: a tiny random Llama, prompts prefilled then decoded over the paged cache, greedy
tokens identical and hidden states within float32 rounding. Without CUDA the kernels run in
Triton's interpreter on the CPU (TRITON_INTERPRET=1), the path forced on there."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import pagoda_kernels.triton.norm as triton_norm  # noqa: E402
import pagoda_kernels.triton.rotary as triton_rotary  # noqa: E402
from pagoda_kernels import cpu as cpu_kernels  # noqa: E402
from services.worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from services.worker.model_loader import load_model  # noqa: E402
from services.worker.models import llama  # noqa: E402
from tests.helpers import (PagedBatchPlanner, PagedSequence, load_config,  # noqa: E402
                           model_config_for, new_kv_caches, save_random_model,
                           tiny_llama_config)

PROMPTS = [[5, 17, 200, 3, 9, 41, 77], [250, 1, 2]]
NEW_TOKENS = 6


def greedy(model, hf_config) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Both prompts in one prefill step, then decode steps of both: tokens and each step's
    hidden states."""
    planner = PagedBatchPlanner(num_blocks=8, block_size=16)
    caches = new_kv_caches(hf_config.num_hidden_layers, 8, 16, hf_config.num_key_value_heads,
                           hf_config.hidden_size // hf_config.num_attention_heads)
    seqs = [PagedSequence(list(p)) for p in PROMPTS]
    step = planner.plan_step([(s, len(s.token_ids)) for s in seqs], [])
    hiddens = []
    for i in range(NEW_TOKENS):
        hidden = model(step.input_ids, step.positions, caches, step.meta)
        hiddens.append(hidden.clone())
        last = step.meta.query_start_loc[1:] - 1
        for seq, token in zip(seqs, model.compute_logits(hidden[last]).argmax(-1).tolist()):
            seq.token_ids.append(token)
        step = planner.plan_step([], seqs)
    return [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)], hiddens


def test_the_triton_norm_and_rotary_give_the_torch_paths_greedy_tokens(tmp_path, monkeypatch):
    hf_config = tiny_llama_config()
    save_random_model(hf_config, tmp_path)
    model = load_model(model_config_for(tmp_path, hf_config), load_config(),
                       torch.device("cpu"), TorchAttentionBackend())
    monkeypatch.setattr(cpu_kernels, "available_for", lambda x: False)  # the CPU's C kernels off
    monkeypatch.setattr(llama, "TRITON_ELEMENTWISE", False)
    want, want_hidden = greedy(model, hf_config)

    calls = {"rms_norm": 0, "rotary_": 0}

    def counted(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)
    counted(triton_norm, "rms_norm")
    counted(triton_rotary, "rotary_")
    monkeypatch.setattr(llama, "TRITON_ELEMENTWISE", True)
    got, got_hidden = greedy(model, hf_config)

    layers = hf_config.num_hidden_layers
    # Every norm (two a layer and the final one) and every layer's rotary, every step.
    assert calls == {"rms_norm": NEW_TOKENS * (2 * layers + 1), "rotary_": NEW_TOKENS * layers}
    assert got == want
    for a, b in zip(got_hidden, want_hidden):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
