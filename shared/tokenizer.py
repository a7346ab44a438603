"""Loading a model's tokenizer from local files (a HF folder or a GGUF file)."""
from functools import lru_cache

from shared.gguf_meta import load_tokenizer as load_gguf_tokenizer
from shared.model_source import resolve_model


@lru_cache(maxsize=4)
def get_tokenizer(tokenizer: str | None):
    """`tokenizer` is a local folder or .gguf path (None: the default model's)."""
    from transformers import AutoTokenizer
    source = resolve_model(tokenizer)
    if source.gguf_file:
        return load_gguf_tokenizer(source)
    return AutoTokenizer.from_pretrained(source.folder)


def eos_token_ids(tokenizer, hf_config=None) -> list[int]:
    """Every id that ends generation: the tokenizer's EOS and the model config's eos ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(hf_config, "eos_token_id", None) if hf_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return sorted(ids)
