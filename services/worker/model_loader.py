"""Builds the model on its device and fills it from a Hugging Face folder (safetensors) or a
GGUF file (services/worker/models/gguf_load.py: read tensor by tensor, dequantized to the
model's dtype, or with `--quantization gguf` kept packed)."""
import glob
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack

import torch
from tqdm import tqdm

from shared.config import LoadConfig, ModelConfig, load_hf_config
from shared.model_source import ModelSource
from services.worker.attention.base import AttentionBackend
from services.worker.models.gguf_load import GGUFFile, load_packed
from services.worker.models.llama import LlamaForCausalLM
from shared.logging import get_logger
from shared.tensor_parallel import TensorParallelShard

log = get_logger("worker")


def load_model(model_config: ModelConfig, load_config: LoadConfig, device: torch.device,
               attn_backend: AttentionBackend, shard: TensorParallelShard | None = None,
               group=None) -> LlamaForCausalLM:
    """The model (or a tensor-parallel rank's `shard` of it, with its `group`) on `device`."""
    # Parameters are created directly on the device, uninitialised: loading overwrites them.
    with torch.device(device):
        model = LlamaForCausalLM(model_config.hf_config, attn_backend, model_config.dtype,
                                 shard, group)
    source = model_config.source
    if model_config.quantization == "gguf":
        if not os.path.isfile(source.path):
            raise FileNotFoundError(f"GGUF file {source.path} does not exist")
        load_packed(model, source.path, model_config.hf_config)
    else:
        if source.gguf_file and device.type == "cpu":
            log.info("gguf weights dequantized to the model dtype; --quantization gguf keeps "
                     "them packed", dtype=str(model_config.dtype).removeprefix("torch."))
        model.load_weights(iter_weights(source, load_config.load_format, model_config.hf_config))
    model.pack_weights(model_config.quantization)
    return model.eval()


def iter_weights(source: ModelSource, load_format: str = "auto",
                 hf_config=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face parameter name, CPU tensor) for every tensor of the checkpoint. A missing
    file fails here, before any tensor is read."""
    if load_format == "auto":
        load_format = "gguf" if source.gguf_file else "safetensors"
    if load_format == "gguf":
        if not source.gguf_file:
            raise ValueError(f"load_format 'gguf' needs a .gguf file, got the folder {source.folder}")
        if not os.path.isfile(source.path):
            raise FileNotFoundError(f"GGUF file {source.path} does not exist")
        return _iter_gguf(source.path, hf_config or load_hf_config(source))
    if load_format == "safetensors":
        if source.gguf_file:
            raise ValueError(f"load_format 'safetensors' cannot read the GGUF file {source.path}")
        return _iter_safetensors(_safetensors_files(source.folder))
    raise ValueError(f"load_format must be auto, safetensors or gguf, got {load_format!r}")


def _safetensors_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder {folder} does not exist")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        # A sharded checkpoint: only the files its index names (a folder may hold others).
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, name) for name in names]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are missing: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(path, framework="pt")) for path in files]
        total = sum(len(h.keys()) for h in handles)
        with tqdm(total=total, desc="Loading safetensors", unit="tensor") as progress:
            for handle in handles:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
                    progress.update()


def _iter_gguf(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor dequantized to fp32 as it is read: one at a time in memory."""
    yield from GGUFFile(path, hf_config).iter_dequantized()
