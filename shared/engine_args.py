"""Flat user arguments (`EngineArgs`) -> one config object per component (config.py).

Configuration flows one way: `EngineArgs.create_engine_config()` checks every value and builds
`PagodaConfig`, and each component reads its own part of it. A bad value fails here, at creation,
with a message that names the field.
"""
import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field, fields

import structlog
import torch

from shared.config import (KV_CACHE_DTYPES, SUPPORTED_ARCHITECTURES, CacheConfig, ConfigError,
                           DeviceConfig, LoadConfig, ModelConfig, PagodaConfig, ParallelConfig,
                           SchedulerConfig, device_for_rank, load_hf_config)
from shared.model_source import ModelNotFoundError, ModelSource, resolve_model
from shared.speculative import (SpeculativeConfig, parse_speculative_config,
                                resolve_draft_model_config)

log = structlog.get_logger("config")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def _has_triton() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


_GPU_MEMORY_UTILIZATION = 0.9  # defaults of the two per-device KV cache budgets
_KV_CACHE_SPACE_GIB = 2.0


@dataclass
class EngineArgs:
    """Flat user arguments; every field is also a command-line flag (`--max-num-seqs`)."""
    model: str | None = None  # local HF folder or GGUF file; None = the default model
    tokenizer: str | None = None
    dtype: str = "auto"  # auto (= float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = field(default="auto", metadata={"help": (
        "what the KV cache stores: auto (the model's --dtype), fp8 (= fp8_e4m3), fp8_e4m3, "
        "fp8_e5m2 (8-bit floats, values saturated to the format's range, no scale), int8 (one "
        "float32 scale per token and KV head); 8 bits hold 2x (bf16) or 4x (float32) the "
        "tokens in the same space (default %(default)s)")})
    # Each sizes the KV cache on one device; None takes that device's default. Set on the
    # other device, it has no effect and a warning says so.
    gpu_memory_utilization: float | None = field(default=None, metadata={"help": (
        "CUDA: the share of device memory that weights, activations (measured by a profile "
        f"run) and the KV cache may fill (default {_GPU_MEMORY_UTILIZATION}); no effect on the "
        "CPU")})
    kv_cache_space_gib: float | None = field(default=None, metadata={"help": (
        f"CPU: GiB of KV cache (default {_KV_CACHE_SPACE_GIB}); no effect on CUDA, where "
        "--gpu-memory-utilization sizes it")})
    swap_space: float = field(default=1.0, metadata={"help": (
        "GiB of CPU memory for blocks swapped out by preemption; allocated only with "
        "--preemption-mode swap (default %(default)s)")})
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    preemption_mode: str = "recompute"
    async_scheduling: bool | None = field(default=None, metadata={"help": (
        "offline LLM: schedule and submit step N+1 while step N runs, as the served engine "
        "always does, so that a GPU worker launches N+1 behind N and never waits for the "
        "host (a sequence that ends in step N is computed once more in N+1, its token "
        "dropped). Default: on for CUDA, off on the CPU, where nothing runs beside the step")})
    tensor_parallel_size: int = 1
    data_parallel_size: int = field(default=1, metadata={"help": (
        "engine replicas, each with its own workers and KV cache, behind the same tokenizers, "
        "detokenizers and gateways (`pagoda serve`; the offline LLM runs one)")})
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    # auto: the compiled CPU kernels on the CPU where they build, else the torch reference ops.
    attention_backend: str = "auto"
    enforce_eager: bool = field(default=False, metadata={"help": (
        "CUDA: run every step eagerly, without the CUDA graphs captured for decode steps at "
        "start-up (no effect on the CPU)")})
    load_format: str = "auto"
    quantization: str | None = field(default=None, metadata={"help": (
        "int8: matmul weights stored as int8 with one scale per output channel and converted "
        "inside the matmul (weight-only; activations stay in --dtype); w8a8: the same weights, "
        "and each row of activations quantized to int8 at every matmul (int8 products, summed "
        "in int32); gguf: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K blocks kept packed and "
        "dequantized inside the matmul (other types requantized to Q8_0); auto: gguf for a "
        "GGUF file, else none; gguf on the CPU only, int8 and w8a8 on the CPU or CUDA (Triton "
        "kernels). Default: weights as loaded (a GGUF file dequantized "
        "to --dtype)")})
    speculative_config: str | dict | None = field(default=None, metadata={"help": (
        "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}, or {\"model\": \"/path/to/draft\", "
        "\"num_speculative_tokens\": 4}; \"disable_by_batch_size\": N turns it off for steps "
        "with more than N decoding sequences (default 8). Default: off")})

    def create_engine_config(self) -> PagodaConfig:
        self._check_types()
        if not 0 <= self.seed < 2 ** 63:
            raise ConfigError("seed", f"must be in [0, 2**63), got {self.seed}")
        device = self._device()
        dtype = self._dtype(device)
        source = self._resolve("model", self.model)
        if self.tokenizer is not None:
            self._resolve("tokenizer", self.tokenizer)
        if (self.load_format == "gguf" and not source.gguf_file
                or self.load_format == "safetensors" and source.gguf_file):
            raise ConfigError("load_format", f"{self.load_format!r} does not match the model "
                                             f"{source.path}")
        hf_config = load_hf_config(source)
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError("model", f"architecture {model_type!r} is not supported "
                                       f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = limit if self.max_model_len is None else self.max_model_len
        if max_model_len <= 0:
            raise ConfigError("max_model_len", f"must be positive, got {max_model_len}")
        if max_model_len > limit:
            raise ConfigError("max_model_len", f"{max_model_len} exceeds the model's "
                                               f"max_position_embeddings ({limit})")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError("block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        gpu_memory_utilization, kv_cache_space_gib = self._kv_cache_budget(device)
        kv_cache_dtype = self._kv_cache_dtype()
        if self.swap_space < 0:
            raise ConfigError("swap_space", f"must be >= 0, got {self.swap_space}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ConfigError("num_gpu_blocks_override",
                              f"must be positive, got {self.num_gpu_blocks_override}")
        if self.max_num_seqs <= 0:
            raise ConfigError("max_num_seqs", f"must be positive, got {self.max_num_seqs}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError("preemption_mode",
                              f"must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ConfigError("swap_space", "preemption_mode 'swap' needs swap_space > 0")
        self._check_tensor_parallel(hf_config, device)
        speculative = self._speculative(hf_config, dtype, max_model_len)
        if self.data_parallel_size < 1:
            raise ConfigError("data_parallel_size",
                              f"must be at least 1, got {self.data_parallel_size}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ConfigError("attention_backend", f"must be auto, torch, cpu or triton, got "
                                                   f"{self.attention_backend!r}")
        if self.attention_backend == "cpu" and device.type != "cpu":
            raise ConfigError("attention_backend", f"'cpu' needs the cpu device, not {device}")
        if self.load_format not in ("auto", "safetensors", "gguf"):
            raise ConfigError("load_format", f"must be auto, safetensors or gguf, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in ("int8", "w8a8", "gguf",
                                                                       "auto"):
            raise ConfigError("quantization", f"must be int8, w8a8, gguf, auto or unset, got "
                                              f"{self.quantization!r}")
        quantization = self._quantization(source)
        if quantization == "gguf" and device.type != "cpu":
            raise ConfigError("quantization", f"{quantization!r} runs on the cpu device "
                                              f"only, not {device}")
        if quantization in ("int8", "w8a8") and device.type == "cuda" and not _has_triton():
            # On CUDA the int8 matmuls are Triton kernels (pagoda_kernels/triton/int8_matmul.py).
            raise ConfigError("quantization", f"{quantization!r} on {device} needs triton, "
                                              f"which is not installed")
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            # Chunked prefill keeps steps short so decodes are not starved by long prompts;
            # 2048 keeps prefill matmuls large enough to run near the CPU's matmul rate
            # (measured: 512 gave 16% less throughput on the benchmark workload).
            max_batched = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        if max_batched <= 0:
            raise ConfigError("max_num_batched_tokens", f"must be positive, got {max_batched}")
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ConfigError("max_num_batched_tokens",
                              f"{max_batched} is smaller than max_model_len ({max_model_len}); "
                              f"without chunked prefill a whole prompt must fit in one step")
        if max_batched < self.max_num_seqs and not self.enable_chunked_prefill:
            max_batched = self.max_num_seqs
        return PagodaConfig(
            model_config=ModelConfig(
                source=source, tokenizer=self.tokenizer or source.path, dtype=dtype,
                seed=self.seed, max_model_len=max_model_len, hf_config=hf_config,
                quantization=quantization),
            cache_config=CacheConfig(
                block_size=self.block_size, gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_space_gib=kv_cache_space_gib, swap_space_gib=self.swap_space,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
                max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                preemption_mode=self.preemption_mode,
                async_scheduling=(device.type == "cuda" if self.async_scheduling is None
                                  else self.async_scheduling)),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            device_config=DeviceConfig(device=device, attention_backend=self.attention_backend,
                                       enforce_eager=self.enforce_eager),
            load_config=LoadConfig(load_format=self.load_format),
            speculative_config=speculative,
        )

    def _speculative(self, hf_config, dtype: torch.dtype, max_model_len: int
                     ) -> SpeculativeConfig | None:
        spec = parse_speculative_config(self.speculative_config)
        if spec is None:
            return None
        if self.tensor_parallel_size > 1:
            raise ConfigError("speculative_config", "does not run with tensor_parallel_size > 1 "
                                                    "yet")
        if spec.method == "draft_model":
            spec.draft_model_config = resolve_draft_model_config(spec.model, hf_config, dtype,
                                                                 max_model_len, self.seed)
        return spec

    def _quantization(self, source: ModelSource) -> str | None:
        """The quantization to run: "auto" is gguf for a GGUF file (weights kept packed), none
        for a Hugging Face folder."""
        quantization = self.quantization
        if quantization == "auto":
            quantization = "gguf" if source.gguf_file else None
        if quantization == "gguf":
            if not source.gguf_file:
                raise ConfigError("quantization", f"'gguf' needs a .gguf model file, got the "
                                                  f"folder {source.path}")
            if self.tensor_parallel_size > 1:
                raise ConfigError("quantization", "'gguf' does not run with "
                                                  "tensor_parallel_size > 1 yet")
        return quantization

    def _check_tensor_parallel(self, hf_config, device: torch.device) -> None:
        """The model splits over that many ranks (shared/tensor_parallel.py), and on CUDA
        there is a GPU for each."""
        from shared.tensor_parallel import shard_for  # it needs ConfigError from here
        size = self.tensor_parallel_size
        if size < 1:
            raise ConfigError("tensor_parallel_size", f"must be at least 1, got {size}")
        for rank in range(size):
            shard_for(hf_config, rank, size)
        if device.type == "cuda" and size > 1:
            device_for_rank(device, size - 1, torch.cuda.device_count())

    def _check_types(self) -> None:
        """Each field holds its annotated type (an int where a float goes is fine, a bool where an
        int goes is not)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and "None" in str(f.type):
                continue
            if f.name == "speculative_config" and isinstance(value, dict):
                continue  # the offline LLM's form; parse_speculative_config checks it
            if _is_bool(f.type):
                ok, expected = isinstance(value, bool), "true or false"
            elif _cli_type(f.type) is float:
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value))
                expected = "a finite number"
            elif _cli_type(f.type) is int:
                ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
            else:
                ok, expected = isinstance(value, (str, os.PathLike)), "a string"
            if not ok:
                raise ConfigError(f.name, f"must be {expected}, got {value!r}")

    @staticmethod
    def _resolve(field_name: str, path: str | None) -> ModelSource:
        try:
            return resolve_model(path)
        except ModelNotFoundError as e:
            raise ConfigError(field_name, str(e)) from None

    def _device(self) -> torch.device:
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(name)
        except RuntimeError as e:
            raise ConfigError("device", f"{name!r} is not a device ({e})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device", "cuda was asked for but no CUDA device is available")
        if device.type not in ("cpu", "cuda"):
            raise ConfigError("device", f"must be cpu or cuda, got {name!r}")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ConfigError("device", f"{name!r}: there are {torch.cuda.device_count()} CUDA "
                                        f"devices")
        return device

    def _kv_cache_budget(self, device: torch.device) -> tuple[float | None, float | None]:
        """(gpu_memory_utilization, kv_cache_space_gib): the one that sizes the KV cache on
        this device, defaulted, and None for the other. The other is still checked; set, it
        is no error (one set of flags may serve both devices) but gets a warning, since it
        changes nothing."""
        gpu, space = self.gpu_memory_utilization, self.kv_cache_space_gib
        if gpu is not None and not 0.0 < gpu <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {gpu}")
        if space is not None and space <= 0:
            raise ConfigError("kv_cache_space_gib", f"must be positive, got {space}")
        if device.type == "cpu":
            space = _KV_CACHE_SPACE_GIB if space is None else space
            if gpu is not None:
                log.warning("gpu_memory_utilization has no effect on the CPU, where "
                            "kv_cache_space_gib sizes the KV cache",
                            gpu_memory_utilization=gpu, kv_cache_space_gib=space)
            return None, space
        gpu = _GPU_MEMORY_UTILIZATION if gpu is None else gpu
        if space is not None:
            log.warning("kv_cache_space_gib has no effect on CUDA, where a profile run and "
                        "gpu_memory_utilization size the KV cache",
                        kv_cache_space_gib=space, gpu_memory_utilization=gpu)
        return gpu, None

    def _kv_cache_dtype(self) -> str:
        """The KV cache's storage, by its canonical name (`fp8` is `fp8_e4m3`)."""
        name = {"fp8": "fp8_e4m3"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if name not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be auto, fp8, fp8_e4m3, fp8_e5m2 or "
                                                f"int8, got {self.kv_cache_dtype!r}")
        return name

    def _dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        elif self.dtype in _DTYPES:
            dtype = _DTYPES[self.dtype]
        else:
            raise ConfigError("dtype", f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if (device.type == "cuda" and dtype == torch.bfloat16
                and not torch.cuda.is_bf16_supported()):
            raise ConfigError("dtype", f"{torch.cuda.get_device_name(device)} has no bfloat16; "
                                       f"use --dtype float16")
        return dtype

    # -- command line ---------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            help_text = f.metadata.get("help")
            if _is_bool(f.type):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=help_text)
            else:
                group.add_argument(flag, type=_cli_type(f.type), default=default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _is_bool(annotation) -> bool:
    return annotation is bool or annotation == (bool | None)


def _cli_type(annotation):
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str
