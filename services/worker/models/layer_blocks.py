"""Decoder layers run as the C layer blocks of pagoda_kernels/cpu/blocks.c, on the CPU, one rank:
`forward_blocks` runs a layer's work before attention and after it in one call each (any step),
`decode_step` a whole decode step's layers, attention included, in one call.

The blocks take every packed weight the CPU matmuls take: bf16 or fp32 panels (activations of
their dtype), int8 / w8a8 panels and GGUF panels (bf16 or fp32 activations). A model some of
whose matmuls are not packed so (oneDNN, fp32 [in, out], a GPU) runs module by module. GGUF weights run their
quantized kernel at any row count here, so a step of more than gguf_weights.KERNEL_MAX_ROWS
tokens (where a dequantized temporary and the dense matmul are faster) runs module by module
too, as does a speculative step whose quantized matmuls the modules split (`LayerBlocks.runs`)."""
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagoda_kernels import cpu as cpu_kernels
from services.worker.attention.base import AttentionMetadata
from services.worker.models import gguf_weights
from services.worker.models.int8 import QUANTIZATIONS
from services.worker.models.plain_rows import max_rows

if TYPE_CHECKING:
    from services.worker.models.linear import Linear
    from services.worker.models.llama import LlamaDecoderLayer, LlamaModel


def block_linear(module: "Linear", dtype: torch.dtype) -> "cpu_kernels.BlockLinear | None":
    """The module's packed weight as the blocks run it with `dtype` activations, or None."""
    packed = module.packed
    if packed is None or dtype not in (torch.bfloat16, torch.float32):
        return None
    n, k = module.weight.shape
    bias = module.bias
    if packed.kind == "bf16" and dtype == torch.bfloat16:
        return cpu_kernels.bf16_block_linear(packed.data, n, k, bias, packed.gate_up)
    if packed.kind == "f32" and dtype == torch.float32:
        return cpu_kernels.f32_block_linear(packed.data, n, k, bias, packed.gate_up)
    if packed.kind in QUANTIZATIONS and packed.data.dim() == 1:  # panels (C kernels built)
        return cpu_kernels.int8_block_linear(packed.data, packed.scale, packed.weight_sums, n, k,
                                             bias, dtype, packed.gate_up, packed.kind == "w8a8")
    if packed.kind == "gguf" and len(packed.gguf.parts) <= 4:
        parts = [(p.qtype, p.row0, p.rows, p.qs, p.d, p.m) for p in packed.gguf.parts]
        return cpu_kernels.gguf_block_linear(parts, n, k, bias, dtype)
    return None


@dataclass
class LayerBlocks:
    """One layer's four matmuls as the blocks run them."""
    qkv: "cpu_kernels.BlockLinear"
    o: "cpu_kernels.BlockLinear"
    gate_up: "cpu_kernels.BlockLinear"
    down: "cpu_kernels.BlockLinear"
    gguf: bool  # some weight is GGUF: steps past its KERNEL_MAX_ROWS run module by module
    int8: bool  # some weight is int8 / w8a8

    def runs(self, x: torch.Tensor) -> bool:
        """Whether the blocks run a step of these rows as the modules would (read at each
        step): not past GGUF's KERNEL_MAX_ROWS (the modules switch to a dequantized temporary
        there), nor, in a speculative step, past the rows at which the modules split a
        quantized matmul to keep it on the plain step's kernel path (models/plain_rows.py)."""
        rows = x.shape[0]
        if self.gguf and rows > gguf_weights.KERNEL_MAX_ROWS.get(self.qkv.dtype, -1):
            return False
        for kind, present in (("gguf", self.gguf), ("int8", self.int8)):
            limit = max_rows(kind, x) if present else None
            if limit is not None and rows > limit:
                return False
        return True

    @classmethod
    def of(cls, layer: "LlamaDecoderLayer") -> "LayerBlocks | None":
        """The layer's blocks, or None where they cannot run it: a weight not packed for them,
        tensor parallelism (o_proj and the MLP run in one call: no room for the sum over ranks
        between), or no C kernels."""
        attn, mlp = layer.self_attn, layer.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        # The packing first: on a GPU nothing is packed for the CPU kernels, which are then
        # never built.
        if attn.group is not None or any(m.packed is None or m.packed.data.device.type != "cpu"
                                         for m in modules):
            return None
        if not cpu_kernels.layer_blocks_available():
            return None
        dtype = layer.input_layernorm.weight.dtype
        linears = [block_linear(m, dtype) for m in modules]
        if any(w is None for w in linears):
            return None
        kinds = {m.packed.kind for m in modules}
        return cls(*linears, gguf="gguf" in kinds, int8=bool(kinds & set(QUANTIZATIONS)))


@dataclass
class LayerWorkspace:
    """One step's activations for `forward_blocks`, shared by every layer in turn."""
    h: torch.Tensor  # [T, hidden] normalised input of a matmul
    qkv: torch.Tensor  # [T, q_size + 2 * kv_size]
    gu: torch.Tensor | None  # [T, 2 * intermediate] gate/up output where SiLU * up is not fused
    act: torch.Tensor  # [T, intermediate] SiLU(gate) * up
    out: torch.Tensor  # [T, hidden] a layer's MLP output

    @classmethod
    def allocate(cls, blocks: LayerBlocks, num_tokens: int) -> "LayerWorkspace":
        dtype = blocks.qkv.dtype

        def empty(cols):
            return torch.empty(num_tokens, cols, dtype=dtype)
        inter = blocks.down.k
        return cls(h=empty(blocks.o.n), qkv=empty(blocks.qkv.n),
                   gu=None if blocks.gate_up.desc.gate_up else empty(2 * inter),
                   act=empty(inter), out=empty(blocks.o.n))


def forward_blocks(layer: "LlamaDecoderLayer", blocks: LayerBlocks, positions: torch.Tensor,
                   x: torch.Tensor, residual: torch.Tensor | None, kv_cache, meta: AttentionMetadata,
                   ws: LayerWorkspace,
                   keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's `forward` with the work before attention and the work after it in one C call
    each: the same kernels, without the interpreter between them. Returns (a view of) ws.out as
    the MLP output, which the next layer reads before overwriting it; with `keep_rows`, only
    those rows go on past attention, as in the layer's `forward`."""
    attn = layer.self_attn
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    cpu_kernels.attention_input(blocks.qkv, x, residual, norm1.weight, norm1.eps, positions,
                                attn.rotary.cos_sin, attn.num_heads + attn.num_kv_heads,
                                attn.head_dim, ws.h, ws.qkv)
    if residual is None:  # the first layer: the residual stream starts as its input
        residual = x
    out = attn.attend(*attn.split_heads(ws.qkv), kv_cache, meta)
    if keep_rows is not None:  # indexing copies: `residual` is not updated in place then
        out, residual = out[keep_rows], residual[keep_rows]
    if not out.is_contiguous():
        out = out.contiguous()
    n = out.shape[0]
    cpu_kernels.attention_output_mlp(blocks.o, blocks.gate_up, blocks.down, out, residual,
                                     norm2.weight, norm2.eps, ws.h[:n],
                                     None if ws.gu is None else ws.gu[:n], ws.act[:n], ws.out[:n])
    return ws.out[:n], residual


class DecodeStep:
    """A whole decode step in one C call (cpu_kernels.decode_layers): every layer's blocks with
    the K/V write and paged decode attention between them, then the final norm. For steps of
    decodes only (one new token per sequence), with the CPU attention backend, on caches in the
    activation dtype or 8 bits; the weights' descriptors are built once per set of caches."""

    def __init__(self, model: "LlamaModel", blocks: list[LayerBlocks]):
        self.model = model
        self.blocks = blocks
        self._weights = None
        self._caches_key = None

    def runs(self, x: torch.Tensor, kv_caches, meta: AttentionMetadata) -> bool:
        """Whether this step is one `__call__` can run."""
        if (kv_caches is None or meta.num_prefills or not x.shape[0]
                or meta.num_decode_tokens != x.shape[0] or not self.blocks[0].runs(x)):
            return False
        attn = self.model.layers[0].self_attn
        k_cache = kv_caches[0][0]
        return (attn.attn_backend.name == "cpu" and k_cache.device.type == "cpu"
                and (k_cache.dtype == x.dtype or k_cache.dtype in cpu_kernels.Q8_CACHE_CODES))

    def _weights_for(self, kv_caches) -> "cpu_kernels.DecodeStepWeights":
        # The descriptors hold the caches' addresses and sizes: a new cache at a freed address
        # must not reuse another's.
        key = tuple((c.data_ptr(), c.shape, c.dtype) for kv in kv_caches for c in kv)
        if key != self._caches_key:
            model = self.model
            layers = []
            for layer, b, (k_cache, v_cache) in zip(model.layers, self.blocks, kv_caches):
                layers.append((b.qkv, b.o, b.gate_up, b.down, layer.input_layernorm.weight,
                               layer.post_attention_layernorm.weight, k_cache, v_cache))
            attn = model.layers[0].self_attn
            self._weights = cpu_kernels.decode_weights(
                layers, model.norm.weight, model.norm.eps, attn.num_heads, attn.num_kv_heads,
                attn.head_dim, attn.rotary.cos_sin, attn.scale)
            self._caches_key = key
        return self._weights

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches,
                 meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] the embedded tokens (overwritten) -> the final norm's output."""
        out = torch.empty_like(x)
        block_tables = meta.block_tables
        if block_tables.stride(1) != 1:
            block_tables = block_tables.contiguous()
        cpu_kernels.decode_layers(self._weights_for(kv_caches), x, positions.contiguous(),
                                  meta.slot_mapping.contiguous(), block_tables,
                                  meta.seq_lens.contiguous(), out)
        return out
