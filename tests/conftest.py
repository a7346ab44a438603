"""Fixtures shared by the engine tests: the default model in transformers (the reference), its
tokenizer, and one offline LLM on the default model with default settings (a small KV cache)."""
import copy
import os

import pytest
import torch

# Without a GPU the Triton kernels (pagoda_kernels/triton) run under Triton's interpreter, which
# `triton.jit` reads when a kernel module is imported: set it for the whole session, before any
# test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shared.model_source import resolve_model

# The test machine's few cores are shared: with more than one intra-op thread, OpenMP threads
# spin against each other and a model step takes several times longer.
torch.set_num_threads(1)


class Reference:
    """The default model in transformers, fp32 unless asked: greedy `generate` (memoised, since
    several tests compare against the same prompts) and raw log-softmax over a token sequence."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        from shared.config import load_hf_config
        source = resolve_model(None)
        # The config converted once and cached (shared/gguf_meta.py): given it, transformers
        # reads the GGUF file for the weights only, not a second time for its metadata (~5 s).
        self.model = AutoModelForCausalLM.from_pretrained(
            source.folder, gguf_file=source.gguf_file, config=load_hf_config(source),
            dtype=dtype).eval()
        self._greedy: dict[tuple, list[int]] = {}

    def cast(self, dtype: torch.dtype) -> "Reference":
        """A copy with its weights cast to `dtype`: parameter for parameter what a load in that
        dtype gives (the GGUF is dequantized to fp32, then rounded), rotary tables fp32 as
        there, without reading the file again."""
        other = object.__new__(Reference)
        other.model = copy.deepcopy(self.model)
        for param in other.model.parameters():  # a tied head is one parameter: cast once
            param.data = param.data.to(dtype)
        other.model.config.dtype = dtype
        other._greedy = {}
        return other

    @torch.no_grad()
    def greedy(self, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_token_ids), max_new_tokens)
        if key not in self._greedy:
            out = self.model.generate(torch.tensor([prompt_token_ids]), do_sample=False,
                                      max_new_tokens=max_new_tokens,
                                      attention_mask=torch.ones(1, len(prompt_token_ids),
                                                                dtype=torch.long))
            self._greedy[key] = out[0, len(prompt_token_ids):].tolist()
        return self._greedy[key]

    @torch.no_grad()
    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab]: row p is the distribution of the token after position p."""
        return self.model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()


@pytest.fixture(scope="session")
def reference_bf16(reference) -> Reference:
    """The same model in bfloat16 (the GGUF dequantized to fp32, then rounded to bf16): the fp32
    reference cast, which is what a bf16 load gives, bit for bit, without a second load."""
    return reference.cast(torch.bfloat16)


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer, loaded once per process (the engine shares it)."""
    from shared.tokenizer import get_tokenizer
    return get_tokenizer(resolve_model(None).path)


@pytest.fixture(scope="session")
def llm():
    """Default settings but a small KV cache and swap space, which are quicker to allocate."""
    from pagoda import LLM
    return LLM(kv_cache_space_gib=0.25, swap_space=0.05)
