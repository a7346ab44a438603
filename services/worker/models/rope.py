"""Rotary embedding frequencies from a Hugging Face config (default, linear and Llama-3
scaling)."""
import math

import torch


def rope_parameters(hf_config) -> dict:
    """The rotary settings, from `rope_parameters` (transformers 5) or the older
    `rope_theta` / `rope_scaling` fields."""
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.update(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_inv_freq(hf_config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with Llama-3 or linear scaling."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    assert params.get("partial_rotary_factor", 1.0) == 1.0, "partial rotary embeddings"
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        original_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between
        # blended smoothly.
        smooth = (original_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
        is_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
        return torch.where(is_band, blended, scaled)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
