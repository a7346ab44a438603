"""The config objects, one per component, that `EngineArgs` (engine_args.py) builds from the
user's flat arguments and checks. Each component reads its own part of `PagodaConfig`.
"""
from dataclasses import dataclass, field

import torch

from shared.model_source import ModelSource
from shared.speculative import SpeculativeConfig


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the field's name."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def device_for_rank(device: torch.device, rank: int, device_count: int) -> torch.device:
    """The device of tensor-parallel rank `rank`: the CPU for every rank; on CUDA one GPU per
    rank, `cuda` meaning GPUs 0, 1, ... and `cuda:N` GPUs N, N+1, ..."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= device_count:
        raise ConfigError("device", f"rank {rank} would run on cuda:{index}, but this host has "
                                    f"{device_count} CUDA device(s)")
    return torch.device("cuda", index)


@dataclass
class ModelConfig:
    source: ModelSource
    tokenizer: str  # folder (or GGUF file) the tokenizer loads from
    dtype: torch.dtype
    seed: int
    max_model_len: int
    hf_config: object = field(repr=False)  # transformers.PretrainedConfig of the architecture
    # "int8": matmul weights kept as int8 with per-row scales (services/worker/models/int8.py)
    # "gguf": a GGUF file's blocks kept packed (services/worker/models/gguf_weights.py)
    quantization: str | None = None

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float | None  # CUDA: share of device memory to fill; None on the CPU
    kv_cache_space_gib: float | None  # CPU: the KV cache's size; None on CUDA
    swap_space_gib: float  # CPU memory for swapped-out blocks (preemption_mode "swap" only)
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    # What the cache blocks hold: "auto" (the model dtype), "fp8_e4m3", "fp8_e5m2" or "int8"
    # (services/worker/cache_engine.py, docs/quantization.md).
    kv_cache_dtype: str = "auto"
    # Filled in after the profile run (Executor.determine_num_available_blocks).
    num_device_blocks: int | None = None
    num_cpu_blocks: int | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str  # "recompute" or "swap"
    # The offline LLM keeps a step in flight, as the engine service always does.
    async_scheduling: bool = False


@dataclass
class ParallelConfig:
    tensor_parallel_size: int


@dataclass
class DeviceConfig:
    device: torch.device
    attention_backend: str = "auto"  # auto, torch, cpu or triton (services/worker/attention)
    enforce_eager: bool = False  # no CUDA graphs for decode steps (services/worker/cuda_graphs)


@dataclass
class LoadConfig:
    load_format: str  # "auto", "safetensors" or "gguf"


@dataclass
class PagodaConfig:
    """Everything one engine replica needs; each component takes its part."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig
    speculative_config: SpeculativeConfig | None = None  # None: one token per step


def load_hf_config(source: ModelSource):
    if source.gguf_file:
        from shared.gguf_meta import load_config
        return load_config(source)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(source.folder)


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")  # canonical --kv-cache-dtype names
