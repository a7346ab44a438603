"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) on the paged KV cache.

Tokens of all sequences in a step are one flat batch ([num_tokens, hidden]); only attention knows
where sequences begin and end (AttentionMetadata). q/k/v and gate/up projections are fused into
one matmul each; `load_weights` stacks the Hugging Face tensors into them. The residual stream
is carried beside the hidden state so that each RMSNorm also does the residual add before it.
On the CPU the element-wise ops run as the compiled kernels of pagoda_kernels/cpu (one pass each), on
CUDA as the Triton kernels of pagoda_kernels/triton (the residual add fused into RMSNorm, rotary in
place); the torch code beside them computes the same and runs everywhere else. Under tensor
parallelism each rank holds its part of every layer (models/shard_weights.py) and the
row-parallel outputs are summed over the group.
"""
import importlib.util
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagoda_kernels import cpu as cpu_kernels
from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.models.gguf_weights import GGUFWeight, gguf_embedding
from services.worker.models.layer_blocks import (DecodeStep, LayerBlocks, LayerWorkspace,
                                                 forward_blocks)
from services.worker.models.linear import (Linear, PackedWeight, SiluAndMulLinear, linear,
                                           pack_weight)
from services.worker.models.rope import rope_inv_freq
from services.worker.models.shard_weights import shard_tensor
from shared.tensor_parallel import TensorParallelShard, shard_for

if TYPE_CHECKING:
    from services.worker.distributed import TensorParallelGroup

KVCache = tuple[torch.Tensor, torch.Tensor]

# RMSNorm and rotary as Triton kernels: None = on CUDA tensors when triton is installed; True
# forces them on any tensor (CPU tensors need TRITON_INTERPRET=1: the tests), False keeps torch.
TRITON_ELEMENTWISE: bool | None = None
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_elementwise_for(x: torch.Tensor) -> bool:
    return (x.is_cuda and _HAS_TRITON) if TRITON_ELEMENTWISE is None else TRITON_ELEMENTWISE


def all_reduce(x: torch.Tensor, group: "TensorParallelGroup | None") -> torch.Tensor:
    """The sum of a row-parallel output over the ranks (nothing to do on one rank)."""
    return x if group is None else group.all_reduce(x)


class Embedding(nn.Module):
    """The embedding table, or on a tensor-parallel rank its rows `vocab` [start, end): ids
    outside them embed as zeros, and the ranks' embeddings are summed."""

    def __init__(self, vocab: tuple[int, int], embedding_dim: int, dtype: torch.dtype,
                 group: "TensorParallelGroup | None" = None):
        super().__init__()
        self.vocab_start, self.vocab_end = vocab
        self.weight = nn.Parameter(torch.empty(vocab[1] - vocab[0], embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.group = group
        self.packed: GGUFWeight | None = None  # --quantization gguf: rows dequantized on lookup

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:  # one rank only (config refuses gguf under TP)
            return gguf_embedding(input_ids, self.packed, self.weight.dtype)
        if self.group is None:
            return F.embedding(input_ids, self.weight)
        held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(held, input_ids - self.vocab_start, 0)
        x = F.embedding(local, self.weight)
        x.masked_fill_(~held.unsqueeze(-1), 0)
        return all_reduce(x, self.group)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """RMSNorm(x); with `residual`: (RMSNorm(x + residual), x + residual), the sum written
        into `residual` in place on the CPU and Triton paths."""
        if cpu_kernels.available_for(x):
            return (cpu_kernels.rms_norm(x, self.weight, self.eps) if residual is None else
                    (cpu_kernels.rms_norm(x, self.weight, self.eps, residual), residual))
        if triton_elementwise_for(x):
            from pagoda_kernels.triton.norm import rms_norm  # triton only where it is chosen
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (the Hugging Face / GPT-NeoX layout):
    [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] = x * [cos, cos] + [x2, x1] * [-sin, sin]."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq = rope_inv_freq(hf_config, head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                             inv_freq)  # [max_positions, head_dim // 2]
        cos, sin = angles.cos(), angles.sin()
        # Computed in float32 once, kept in the model dtype since the rotation is applied in it;
        # one table so that a step looks its positions up once.
        table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)
        self.register_buffer("cos_sin", table.to(dtype), persistent=False)  # [max_pos, 2, head_dim]
        self.half = head_dim // 2

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> rotated (in place on the CPU and Triton paths, a copy
        otherwise)."""
        if cpu_kernels.available_for(x):
            return cpu_kernels.rotary_(x, positions, self.cos_sin)
        if triton_elementwise_for(x):
            from pagoda_kernels.triton.rotary import rotary_
            return rotary_(x, positions, self.cos_sin)
        cos, sin = self.cos_sin.index_select(0, positions).unsqueeze(1).unbind(2)  # [T, 1, D]
        return torch.addcmul(x * cos, x.roll(self.half, dims=-1), sin)


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (all of them on one rank)."""

    def __init__(self, hf_config, attn_backend: AttentionBackend, rotary: RotaryEmbedding,
                 dtype: torch.dtype, shard: TensorParallelShard,
                 group: "TensorParallelGroup | None" = None):
        super().__init__()
        c = hf_config
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.group = group
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        assert self.num_heads % self.num_kv_heads == 0
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        qkv_bias = c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False))
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, c.hidden_size, bool(getattr(c, "attention_bias", False)),
                             dtype)  # row-parallel: summed over the ranks
        self.rotary = rotary
        self.attn_backend = attn_backend

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache | None,
                meta: AttentionMetadata, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """-> [T, hidden], or with `keep_rows` only those rows of it."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k rotated together: one set of ops for both.
        qk = self.rotary(positions, qk.view(num_tokens, self.num_heads + self.num_kv_heads,
                                            self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attend(q, k, v, kv_cache, meta)
        if keep_rows is not None:
            out = out[keep_rows]
        return all_reduce(self.o_proj(out), self.group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: KVCache | None, meta: AttentionMetadata) -> torch.Tensor:
        """The backend's attention of q [T, heads, D] over k, v [T, kv_heads, D] and the cache
        -> [T, q_size]."""
        k_cache, v_cache = kv_cache if kv_cache is not None else (None, None)
        out = self.attn_backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.q_size)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, q_size + 2 * kv_size] -> views q [T, heads, D], k and v [T, kv_heads, D]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(num_tokens, self.num_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))


class LlamaMLP(nn.Module):
    """The MLP over this rank's intermediate columns (all of them on one rank)."""

    def __init__(self, hf_config, dtype: torch.dtype, shard: TensorParallelShard,
                 group: "TensorParallelGroup | None" = None):
        super().__init__()
        c = hf_config
        assert getattr(c, "hidden_act", "silu") == "silu", c.hidden_act
        bias = bool(getattr(c, "mlp_bias", False))
        inter = shard.intermediate_size
        self.gate_up_proj = SiluAndMulLinear(c.hidden_size, 2 * inter, bias, dtype)
        self.down_proj = Linear(inter, c.hidden_size, bias, dtype)  # row-parallel
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SiLU(gate) * up: [T, intermediate]
        return all_reduce(self.down_proj(self.gate_up_proj(x)), self.group)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, rotary: RotaryEmbedding,
                 dtype: torch.dtype, shard: TensorParallelShard,
                 group: "TensorParallelGroup | None" = None):
        super().__init__()
        c = hf_config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(c, attn_backend, rotary, dtype, shard, group)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(c, dtype, shard, group)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache | None, meta: AttentionMetadata,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output, the residual stream before it); their sum is the
        layer's output, formed by the next norm. With `keep_rows`, every token still goes
        through attention (the cache needs its K and V), and only those rows go on through
        o_proj and the MLP."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, keep_rows)
        if keep_rows is not None:
            residual = residual[keep_rows]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config, attn_backend: AttentionBackend, dtype: torch.dtype,
                 shard: TensorParallelShard, group: "TensorParallelGroup | None" = None):
        super().__init__()
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        max_positions = getattr(c, "max_position_embeddings", None) or 2048
        self.embed_tokens = Embedding(shard.vocab, c.hidden_size, dtype, group)
        # One cos/sin table shared by every layer.
        rotary = RotaryEmbedding(c, head_dim, max_positions, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c, attn_backend, rotary, dtype, shard, group)
                                    for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        # The C layer blocks (models/layer_blocks.py), set up once the weights are packed where
        # they run every layer; `use_blocks` and `use_decode_step` can turn them off.
        self.layer_blocks: list[LayerBlocks] | None = None
        self.decode_step: DecodeStep | None = None
        self.use_blocks = False
        self.use_decode_step = True

    def set_up_blocks(self) -> None:
        blocks = [LayerBlocks.of(layer) for layer in self.layers]
        ready = all(b is not None for b in blocks)
        self.layer_blocks = blocks if ready else None
        self.decode_step = DecodeStep(self, blocks) if ready else None
        self.use_blocks = ready

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache] | None, meta: AttentionMetadata,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """-> the final norm's output [T, hidden], or with `keep_rows` (row indices, in the
        order wanted) only those rows: the last layer then runs o_proj and the MLP for them
        alone (see `can_keep_rows`); a decode step in one C call computes every row and
        returns those."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        blocks = self.layer_blocks if self.use_blocks and cpu_kernels.available_for(x) else None
        if blocks is not None and not blocks[0].runs(x):
            blocks = None
        if blocks is not None and self.use_decode_step and self.decode_step.runs(x, kv_caches,
                                                                                meta):
            hidden = self.decode_step(x, positions, kv_caches, meta)
            return hidden if keep_rows is None else hidden[keep_rows]
        ws = LayerWorkspace.allocate(blocks[0], x.shape[0]) if blocks is not None else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            kv_cache = kv_caches[i] if kv_caches is not None else None
            keep = keep_rows if i == last else None
            x, residual = (layer(positions, x, residual, kv_cache, meta, keep) if ws is None else
                           forward_blocks(layer, blocks[i], positions, x, residual, kv_cache,
                                          meta, ws, keep))
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    @property
    def can_keep_rows(self) -> bool:
        """Whether `forward` may be given `keep_rows`. Not where the last layer has a quantized
        weight: those kernels pick a path by the rows of x, and a speculative step must take
        the plain step's path (models/plain_rows.py), which fewer rows could leave. Not under
        tensor parallelism, where it has not been tried. Float weights may: the panel kernels
        give a row the same bits at any row count; other libraries' matmuls (oneDNN, MKL,
        cuBLAS) need not, as for any change in a step's batch."""
        last = self.layers[-1]
        attn, mlp = last.self_attn, last.mlp
        if attn.group is not None or mlp.group is not None:
            return False
        return all(m.packed is None or m.packed.kind in ("bf16", "f32", "onednn")
                   for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))


# Hugging Face projection name -> (our fused projection, index of its slice).
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    """The model, or with `shard` and `group` one tensor-parallel rank's part of it
    (shared/tensor_parallel.py, services/worker/models/shard_weights.py)."""

    def __init__(self, hf_config, attn_backend: AttentionBackend, dtype: torch.dtype,
                 shard: TensorParallelShard | None = None,
                 group: "TensorParallelGroup | None" = None):
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.shard = shard or shard_for(hf_config)
        self.group = group if self.shard.world_size > 1 else None
        self.model = LlamaModel(hf_config, attn_backend, dtype, self.shard, self.group)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head_packed: PackedWeight | None = None  # a tied head's packed copy
        self.packed = False  # weights prepared by `pack_weights`; loading is over then
        if not self.tie_word_embeddings:
            self.lm_head = Linear(hf_config.hidden_size, self.shard.vocab_rows, False, dtype)
        attn = self.model.layers[0].self_attn
        mlp = self.model.layers[0].mlp
        inter = mlp.down_proj.weight.shape[1]
        # Row ranges of each Hugging Face tensor inside a fused weight.
        self._shard_rows = {
            "qkv_proj": [(0, attn.q_size), (attn.q_size, attn.kv_size),
                         (attn.q_size + attn.kv_size, attn.kv_size)],
            "gate_up_proj": [(0, inter), (inter, inter)],
        }

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache] | None, attn_metadata: AttentionMetadata,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states after the final norm [T, hidden], or only
        the rows `keep_rows` (LlamaModel.forward)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, keep_rows)

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] in the model's dtype (the sampler reads bf16 logits
        directly where it can, and converts them to float32 where it must). Tensor-parallel:
        every rank computes its vocabulary range, and only the leader gets the logits."""
        if not self.tie_word_embeddings:
            logits = self.lm_head(hidden_states)
        else:
            logits = linear(hidden_states, self.model.embed_tokens.weight, None,
                            self.lm_head_packed)
        if self.group is None:
            return logits
        logits = self.group.gather_last_dim(logits)
        return None if logits is None else logits[:, :self.shard.vocab_size]

    def pack_weights(self, quantization: str | None = None) -> None:
        """After loading: prepare every matmul weight for the device's fastest kernel. The head
        is the largest matmul and is packed in fp32 too (a copy of the embedding, when tied).
        `quantization="int8"` or `"w8a8"`: every matmul weight, the head included, as int8 rows
        and scales, one tensor at a time; a tied embedding table itself stays as loaded."""
        if quantization != "gguf":  # gguf: packed as loaded (models/gguf_load.py)
            head_dtypes = (torch.bfloat16, torch.float32)
            for name, module in self.named_modules():
                if isinstance(module, Linear):
                    module.pack(head_dtypes if name == "lm_head" else (torch.bfloat16,),
                                quantization)
            if self.tie_word_embeddings:
                self.lm_head_packed = pack_weight(self.model.embed_tokens.weight, head_dtypes,
                                                  quantization=quantization)
        # All layers or none: a model some of whose matmuls went to oneDNN runs module by module.
        self.model.set_up_blocks()
        self.packed = True

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face named tensors into the model; every parameter must be filled."""
        if self.packed:
            raise RuntimeError("load_weights after pack_weights: the packed copies would be stale")
        params = dict(self.named_parameters())
        attn = self.model.layers[0].self_attn
        # What must be loaded: whole parameters, and each slice of a fused one.
        expected = set()
        for name in params:
            module = name.rsplit(".", 2)[-2]
            num_slices = len(self._shard_rows.get(module, [None]))
            expected.update(f"{name}#{i}" for i in range(num_slices))
        loaded = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # recomputed, not loaded
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some checkpoints store the tied copy too
            prefix, module, kind = ([""] + hf_name.rsplit(".", 2))[-3:]
            fused, index = _STACKED.get(module, (module, 0))
            name = f"{prefix}.{fused}.{kind}".lstrip(".")
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model")
            target = params[name]
            tensor = shard_tensor(hf_name, tensor, self.shard, attn.head_dim)
            if fused in self._shard_rows:
                target = target.narrow(0, *self._shard_rows[fused][index])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model expects {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(f"{name}#{index}")
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
