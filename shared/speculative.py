"""Speculative decoding's settings (`--speculative-config`, vLLM's JSON) and which requests may
speculate.

`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`
proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens
(services/worker/ngram_proposer.py); `{"model": "/path/to/draft", "num_speculative_tokens": 4}`
("draft_model", inferred from "model") runs a smaller model of the same tokenizer. Either way
the target verifies every proposal in one forward pass (services/worker/rejection_sampler.py).
"""
import json
from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams

FIELD = "speculative_config"
METHODS = ("ngram", "draft_model")
# Above this many decoding sequences in a step, speculation is off for the step: the batch is
# then wide enough that verifying k extra tokens per sequence costs more than it saves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# The engine's health details carry accepted proposals per position as one key each: this
# prefix, then the position (0-based); the gateway's /metrics reads them back.
ACCEPTED_PER_POS_DETAIL = "spec_decode_num_accepted_tokens_pos_"
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "disable_by_batch_size"}


@dataclass
class SpeculativeConfig:
    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: proposals per sequence and step, at most
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # draft_model: its local folder or GGUF file
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft_model: the draft's shared.config.ModelConfig, built with the engine's config.
    draft_model_config: object = field(default=None, repr=False)


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """JSON text or a dict -> SpeculativeConfig (None: speculation off). Raises
    shared.config.ConfigError naming `speculative_config` for anything it cannot use."""
    from shared.config import ConfigError  # config imports this module
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(FIELD, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(FIELD, f"must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ConfigError(FIELD, f"unknown key(s) {', '.join(unknown)} (known: "
                                 f"{', '.join(sorted(_KEYS))})")
    method = value.get("method")
    model = value.get("model")
    if method is None:
        method = "draft_model" if model is not None else None
    if method not in METHODS:
        raise ConfigError(FIELD, f"method must be one of {', '.join(METHODS)} (or give "
                                 f"\"model\" for a draft model), got {method!r}")
    if method == "draft_model" and not (isinstance(model, str) and model):
        raise ConfigError(FIELD, "method 'draft_model' needs \"model\": the draft's folder or "
                                 "GGUF file")
    if method == "ngram" and model is not None:
        raise ConfigError(FIELD, "method 'ngram' takes no \"model\"")

    def integer(key: str, default: int | None, least: int) -> int:
        v = value.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ConfigError(FIELD, f"{key} must be an integer >= {least}, got {v!r}")
        return v

    k = integer("num_speculative_tokens", None, 1)
    lookup_max = integer("prompt_lookup_max", 4, 1)
    lookup_min = integer("prompt_lookup_min", min(lookup_max, 1), 1)
    if lookup_min > lookup_max:
        raise ConfigError(FIELD, f"prompt_lookup_min ({lookup_min}) is above prompt_lookup_max "
                                 f"({lookup_max})")
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, prompt_lookup_max=lookup_max,
        prompt_lookup_min=lookup_min, model=model,
        disable_by_batch_size=integer("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1))


def resolve_draft_model_config(path: str, hf_config, dtype, max_model_len: int, seed: int):
    """The draft's shared.config.ModelConfig: a local Llama-family model whose token ids are
    the target's (`hf_config`), long enough for max_model_len, run in the target's dtype.
    Raises ConfigError naming `speculative_config` otherwise."""
    from shared.config import (SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig,
                               load_hf_config)
    from shared.model_source import ModelNotFoundError, resolve_model
    try:
        source = resolve_model(path)
    except ModelNotFoundError as e:
        raise ConfigError(FIELD, f"draft model: {e}") from None
    draft = load_hf_config(source)
    model_type = getattr(draft, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(FIELD, f"draft model: architecture {model_type!r} is not supported")
    if draft.vocab_size != hf_config.vocab_size:
        raise ConfigError(FIELD, f"draft model: its vocabulary has {draft.vocab_size} ids, the "
                                 f"model's {hf_config.vocab_size}: they must share the "
                                 f"tokenizer")
    limit = getattr(draft, "max_position_embeddings", None) or 2048
    if limit < max_model_len:
        raise ConfigError(FIELD, f"draft model: max_position_embeddings {limit} is below "
                                 f"max_model_len {max_model_len}")
    return ModelConfig(source=source, tokenizer=source.path, dtype=dtype, seed=seed,
                       max_model_len=max_model_len, hf_config=draft)


def may_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next step may verify proposals. Requests whose logits depend on
    more than the model's distribution at each position (penalties, biases, allowed ids, a
    grammar, min_tokens not reached), that ask for logprobs, or that draw several samples
    decode one token per step instead: speculation would have to apply those per verified
    position, and they are rare enough not to be worth it."""
    p = params
    return (p.n == 1 and p.structured_outputs is None and p.logprobs is None
            and not p.uses_penalties and not p.logit_bias and not p.allowed_token_ids
            and num_output_tokens >= p.min_tokens)
