"""Reading a GGUF file tensor by tensor from a memory map of it: dequantized (a GGUF model
without `--quantization`) or kept packed (`--quantization gguf`).

GGUF tensor names map onto the Hugging Face names of a Llama-family model; llama.cpp stores the
rows of q and k (and their biases) permuted for its rotary layout, and for the "llama"
architecture they are put back in Hugging Face's order, as transformers' GGUF reader does. The
permutation moves whole rows, so packed rows of blocks are permuted as they are.

After each tensor is copied, its pages of the map are released (madvise DONTNEED): they stay
in the page cache, but do not count against this process, so a load holds the model once.
"""
import math
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.models.gguf_weights import (PACKED_TYPES, Q8_0, GGUFWeight, allocate_part,
                                                 fill_from_blocks, fill_from_float)
from shared.logging import get_logger

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

log = get_logger("worker")

_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Our fused projections and the Hugging Face tensors stacked in them, in row order.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one the model does not load (e.g.
    rope_freqs, recomputed from the config)."""
    base, kind = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        mapped = _LAYER.get(part)
        return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
    mapped = _TOP.get(base)
    return f"{mapped}.{kind}" if mapped else None


@dataclass
class GGUFTensor:
    """One tensor of the file: `data` is a view of the map, shaped as gguf's reader shapes it
    (quantized rows as bytes, [..., row bytes])."""
    name: str
    shape: tuple[int, ...]  # ggml's order: the innermost (row) dimension first
    tensor_type: "GGMLQuantizationType"
    data_offset: int  # from the start of the file
    n_bytes: int
    data: np.ndarray


# Bytes of each fixed-size GGUF metadata value type (uint8 .. float64; 8 is a string, 9 an array).
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


def read_tensors(path: str) -> tuple[str | None, dict[str, GGUFTensor], np.memmap]:
    """(architecture, tensors by GGUF name, the file's map) from a little-endian GGUF file
    (version 2 or 3). The metadata is skipped rather than parsed: gguf's GGUFReader builds an
    array for every token and merge of the vocabulary, ~150 MiB at once for the default model,
    more than its packed weights."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    with open(path, "rb") as f:
        def take(fmt: str):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))

        def string() -> bytes:
            (n,) = take("<Q")
            return f.read(n)

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(take("<Q")[0], 1)
            elif vtype == 9:
                sub, count = take("<IQ")
                if sub in _VALUE_BYTES:
                    f.seek(_VALUE_BYTES[sub] * count, 1)
                else:
                    for _ in range(count):
                        skip(sub)
            else:
                f.seek(_VALUE_BYTES[vtype], 1)

        magic, version, n_tensors, n_kv = take("<4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF file of version 2 or 3")
        arch, alignment = None, 32
        for _ in range(n_kv):
            key = string()
            (vtype,) = take("<I")
            if key == b"general.architecture" and vtype == 8:
                arch = string().decode()
            elif key == b"general.alignment" and vtype == 4:
                (alignment,) = take("<I")
            else:
                skip(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string().decode()
            (n_dims,) = take("<I")
            dims = take(f"<{n_dims}Q")
            qtype, offset = take("<IQ")
            infos.append((name, dims, qtype, offset))
        start = f.tell()
    start += -start % alignment
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, qtype, offset in infos:
        kind = GGMLQuantizationType(qtype)
        block, type_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = math.prod(dims) // block * type_bytes
        raw = whole[start + offset:start + offset + n_bytes]
        if kind.name in _PLAIN_DTYPES:
            data = raw.view(_PLAIN_DTYPES[kind.name]).reshape(dims[::-1])
        else:
            data = raw.reshape(*dims[:0:-1], dims[0] // block * type_bytes)
        tensors[name] = GGUFTensor(name, tuple(dims), kind, start + offset, n_bytes, data)
    return arch, tensors, whole


class GGUFFile:
    """A GGUF file's tensors by Hugging Face name, read through a memory map of the file."""

    def __init__(self, path: str, hf_config):
        self.architecture, tensors, self.map = read_tensors(path)
        self.tensors = {}
        for t in tensors.values():
            name = hf_name(t.name)
            if name is not None:
                self.tensors[name] = t
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads

    def row_order(self, name: str, rows: int) -> np.ndarray | None:
        """For q and k of a "llama" file: the file row that each Hugging Face row is."""
        if self.architecture != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = self.num_heads if ".q_proj." in name else self.num_kv_heads
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)

    def release(self, name: str) -> None:
        """Drop this tensor's pages of the map from the process (they stay in the page cache)."""
        t = self.tensors[name]
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self.map._mmap.madvise(mmap.MADV_DONTNEED, start,
                                           t.data_offset + int(t.n_bytes) - start)
        except (AttributeError, OSError, ValueError):
            pass  # only the peak memory of the load is at stake

    def dequantized(self, name: str) -> torch.Tensor:
        """The tensor in fp32 (rows in Hugging Face's order), as gguf's dequantize gives it."""
        from gguf import dequantize
        t = self.tensors[name]
        w = dequantize(t.data, t.tensor_type)
        order = self.row_order(name, w.shape[0])
        w = w[order] if order is not None else np.array(w)  # a copy either way: off the map
        self.release(name)
        return torch.from_numpy(w)

    def iter_dequantized(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in list(self.tensors):
            yield name, self.dequantized(name)

    def packed_type(self, name: str, k: int) -> int:
        """The type `name` is kept in: its own where a kernel takes it, else Q8_0. Raises
        ValueError for K not a multiple of 32 (an F16 / F32 matrix can have one): every packed
        type, Q8_0 included, is blocks of 32 weights of a row."""
        if k % 32:
            raise ValueError(f"{name}: {k} inputs, not a multiple of 32: --quantization gguf "
                             f"keeps matrices in blocks of 32 weights of a row; load the file "
                             f"without --quantization to run it dense")
        qtype = int(self.tensors[name].tensor_type)
        return qtype if qtype in PACKED_TYPES else Q8_0

    def packed_into(self, weight: GGUFWeight, names: list[str]) -> None:
        """Fill `weight` with the tensors `names` stacked by rows, one part per run of tensors
        kept in one type: a packed type's blocks copied once into place, any other type
        dequantized and requantized to Q8_0."""
        k = weight.in_features
        row0 = 0
        runs: list[tuple[int, list[str]]] = []
        for name in names:
            t = self.tensors[name]
            if int(t.shape[0]) != k or len(t.shape) != 2:
                raise ValueError(f"{name}: GGUF shape {list(t.shape)}, model expects {k} inputs")
            qtype = self.packed_type(name, k)
            if runs and runs[-1][0] == qtype:
                runs[-1][1].append(name)
            else:
                runs.append((qtype, [name]))
        for qtype, run in runs:
            rows = [int(self.tensors[name].shape[1]) for name in run]
            part = allocate_part(qtype, row0, sum(rows), k)
            start = 0
            for name, n in zip(run, rows):
                t = self.tensors[name]
                if int(t.tensor_type) == qtype:
                    blocks = t.data.reshape(n, -1)
                    order = self.row_order(name, n)
                    fill_from_blocks(part, start, blocks[order] if order is not None else blocks)
                    self.release(name)
                else:
                    log.info("gguf tensor requantized to Q8_0", tensor=t.name,
                             type=t.tensor_type.name)
                    fill_from_float(part, start, self.dequantized(name))
                start += n
            weight.parts.append(part)
            row0 += sum(rows)


def load_packed(model, path: str, hf_config) -> None:
    """Fill `model` (a LlamaForCausalLM on the CPU, one rank) from the GGUF file at `path` with
    its matmul weights and embedding table packed; norms and biases in the model's dtype."""
    from services.worker.models.linear import Linear, PackedWeight, drop_plain_weight
    file = GGUFFile(path, hf_config)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    packed_bytes = 0

    def hf_parts(module_name: str) -> list[str]:
        prefix, module = ([""] + module_name.rsplit(".", 1))[-2:]
        names = _FUSED.get(module, (module,))
        return [f"{prefix}.{n}".lstrip(".") for n in names]

    def require(names: list[str]) -> None:
        missing = [n for n in names if n not in file.tensors]
        if missing:
            raise ValueError(f"GGUF file {path} lacks {missing}")

    for module_name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        parts = hf_parts(module_name)
        require([f"{p}.weight" for p in parts])
        k = module.weight.shape[1]
        drop_plain_weight(module)  # never filled: its memory is never touched
        weight = GGUFWeight(k)
        file.packed_into(weight, [f"{p}.weight" for p in parts])
        if weight.out_features != module.weight.shape[0]:
            raise ValueError(f"{module_name}: GGUF rows {weight.out_features}, model expects "
                             f"{module.weight.shape[0]}")
        module.packed = PackedWeight("gguf", weight.parts[0].qs, weight.out_features,
                                     gguf=weight)
        packed_bytes += weight.nbytes
        loaded.add(f"{module_name}.weight")
        if module.bias is not None:
            require([f"{p}.bias" for p in parts])
            with torch.no_grad():
                module.bias.copy_(torch.cat([file.dequantized(f"{p}.bias") for p in parts]))
            loaded.add(f"{module_name}.bias")

    embed = model.model.embed_tokens
    require(["model.embed_tokens.weight"])
    drop_plain_weight(embed)
    table = GGUFWeight(embed.weight.shape[1])
    file.packed_into(table, ["model.embed_tokens.weight"])
    if table.out_features != embed.weight.shape[0]:
        raise ValueError(f"embedding: GGUF rows {table.out_features}, model expects "
                         f"{embed.weight.shape[0]}")
    embed.packed = table
    packed_bytes += table.nbytes
    loaded.add("model.embed_tokens.weight")
    if model.tie_word_embeddings:
        model.lm_head_packed = PackedWeight("gguf", table.parts[0].qs, table.out_features,
                                            gguf=table)

    with torch.no_grad():
        for name, param in params.items():
            if name in loaded:
                continue
            require([name])  # norms
            param.copy_(file.dequantized(name))
            loaded.add(name)
    types = {p.qtype for m in model.modules() if isinstance(m, Linear) for p in m.packed.gguf.parts}
    from gguf import GGMLQuantizationType
    log.info("gguf weights kept packed", path=path, packed_mib=round(packed_bytes / 2 ** 20, 1),
             types=sorted(GGMLQuantizationType(t).name for t in types | {table.parts[0].qtype}))
