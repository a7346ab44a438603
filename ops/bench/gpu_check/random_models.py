"""Random-weight models for the parity, throughput and serve sections: transformers configs and
models, a word tokenizer, the folder pagoda loads, random prompts, and pagoda's offline engine
on such a folder."""
import contextlib
import os
import random

from .measure import device_of, free_device_memory
from .report import Run


def hf_config(architecture: str, kwargs: dict):
    """A transformers config without end-of-sequence or padding ids: transformers then
    generates every requested token, as pagoda does with ignore_eos."""
    from transformers import LlamaConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[architecture]
    return cls(**kwargs, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def random_model(config, dtype, device, seed: int):
    """A transformers model with random weights, created on the device directly (an 8B model
    on the CPU would take minutes)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def word_tokenizer(vocab_size: int):
    """A tokenizer over the whole vocabulary (id i is the word 't<i>', 0 the unknown word):
    pagoda loads a tokenizer from the model's folder, and random models come with none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def save_folder(run: Run, model, name: str) -> str:
    """The model and a tokenizer as a Hugging Face folder (safetensors), what LLM(model=)
    loads."""
    folder = os.path.join(run.work_dir, name)
    model.save_pretrained(folder)
    word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def random_prompts(vocab_size: int, lengths: list, seed: int) -> list:
    """Token ids drawn from the vocabulary past id 0 (the tokenizer's only special token)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


@contextlib.contextmanager
def pagoda_engine(run: Run, folder: str, **kwargs):
    """pagoda's offline LLM on the folder; its KV cache and weights freed on the way out, so
    that the next engine's memory profile sees the device empty."""
    from pagoda import LLM
    device = device_of(run)
    llm = LLM(model=folder, device=run.plan.device, **run.plan.engine_kwargs, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.executor.worker.free_cache()
        del llm
        free_device_memory(device)
