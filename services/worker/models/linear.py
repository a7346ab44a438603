"""Matmul weights prepared once, after loading, for the CPU's fastest kernel.

- bf16: packed into oneDNN's blocked layout. The plain bf16 matmul repacks the weight on every
  call, which at decode batch sizes costs as much as the product (measured, 30 layers of the
  default model at batch 64: 1.6x faster packed; the same at 2048 tokens).
- fp32: the weight is stored [in, out] (the parameter becomes a transposed view of a copy made
  once at load, same values): MKL's sgemm is ~12% faster at batch 64 with that layout and the same at 1-2048
  tokens. oneDNN's fp32 packing is slower on prompt-sized batches, so only the LM head, which
  only ever sees the sampled rows, is packed in fp32 (1.3x).
Elsewhere (GPU, fp16, no oneDNN bf16) weights stay as loaded and F.linear runs. A packed
weight's plain copy is dropped (`drop_plain_weight`): only its shape and dtype remain.
"""
import torch
import torch.nn.functional as F
from torch import nn


def _onednn(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear, with bf16 instructions on this CPU for bf16 (else emulated)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def pack_weight(weight: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)
                ) -> torch.Tensor | None:
    """The weight [out, in] reordered into oneDNN's layout, if its dtype is one of `dtypes` and
    it is on the CPU; None otherwise."""
    if weight.device.type != "cpu" or weight.dtype not in dtypes or not _onednn(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def drop_plain_weight(module: nn.Module) -> None:
    """Replace `module.weight` by a meta tensor of the same shape and dtype once a packed copy
    does its work, so the weight is not held twice."""
    weight = module.weight
    module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b). Left uninitialised: `load_weights` fills every parameter."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None  # set by `pack` once the weight is loaded

    def pack(self, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> None:
        weight = self.weight
        self.packed = pack_weight(weight, dtypes)
        if self.packed is not None:
            drop_plain_weight(self)
        elif weight.device.type == "cpu" and weight.dtype == torch.float32:
            weight.data = weight.data.t().contiguous().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
