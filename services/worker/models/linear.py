"""Matmul weights prepared once, after loading, for the CPU's fastest kernel.

- bf16 on a CPU with AVX512-BF16 (and AMX, where granted): packed into the panels of
  pagoda_kernels/cpu/matmul_bf16.c, whose AMX loop streams the weight at up to twice oneDNN's rate at
  decode batch sizes and whose vdpbf16ps loop takes a decode step's matmuls in ~24% less time
  than oneDNN (faster on the layers, about even on the LM head); both keep up with it on
  prompts. The fused gate/up projection also applies SiLU(gate) * up before anything
  is written.
- bf16 on a CPU with AVX2 and FMA but no AVX-512: the same panels, multiplied in fp32 by
  matmul_bf16_avx2.c (oneDNN has no bf16 kernel there: torch's bf16 matmul ran ~6x slower).
- bf16 elsewhere on the CPU (or a shape that kernel does not take): packed into oneDNN's blocked
  layout. The plain bf16 matmul repacks the weight on every call, which at decode batch sizes
  costs as much as the product (measured, 30 layers of the default model at batch 64: 1.6x
  faster packed; the same at 2048 tokens).
- fp32: packed into the panels of pagoda_kernels/cpu/matmul_f32.c (AVX-512; AVX2 and FMA:
  matmul_f32_avx2.c), stored [in, out] (the parameter becomes a transposed view of a copy made once at load, same values), or packed for
  oneDNN, whichever this CPU runs fastest (`fp32_layout`, timed once per process, panels
  preferred on a tie since the C layer blocks take them). On Intel Xeons MKL's sgemm was ~12%
  faster than oneDNN at batch 64 with [in, out] and the same at 1-2048 tokens; on a Zen 4
  oneDNN's packed matmul was 1.3-2.3x faster than MKL at batch 64, and the panels about even
  with oneDNN cache-warm and 5-15% faster with the weights streamed from memory, as in a
  decode step. The LM head, which only ever sees the sampled rows, is packed in fp32 either
  way: panels where that is the layout, else oneDNN (1.3x over MKL on the Xeons). Where panels
  are the layout, a weight they do not take (N not a multiple of 32) is packed for oneDNN.
The panel-packed weights and the [in, out] fp32 copies live on huge pages
(services/worker/host_memory.py).
- `--quantization int8` / `w8a8` (any dtype, on the CPU): int8 weights and per-row scales in
  the panels of pagoda_kernels/cpu/matmul_int8.c, weight-only or with activations quantized per row
  (services/worker/models/int8.py); the gate/up SiLU * up in the kernel's epilogue.
- `--quantization gguf` (a GGUF file, on the CPU): the file's Q8_0 / Q4_0 / Q4_1 blocks, packed
  as they are loaded (services/worker/models/gguf_load.py) and multiplied by
  pagoda_kernels/cpu/matmul_gguf.c (services/worker/models/gguf_weights.py).
Elsewhere (GPU, fp16) weights stay as loaded and F.linear runs. A packed weight's plain copy is
dropped (`drop_plain_weight`): only its shape and dtype remain.
"""
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pagoda_kernels import cpu as cpu_kernels
from shared.logging import get_logger
from services.worker.host_memory import host_copy, host_empty
from services.worker.models.gguf_weights import GGUFWeight, gguf_linear
from services.worker.models.int8 import (QUANTIZATIONS, TRITON_QUANTIZATIONS, int8_linear,
                                          quantize_rows, quantize_weight, triton_int8_for,
                                          triton_int8_linear)
from services.worker.models.plain_rows import in_pieces, max_rows


@dataclass
class PackedWeight:
    """A weight [out_features, in_features] rearranged for one kernel."""
    kind: str  # "bf16" / "f32": pagoda_kernels.cpu.bf16_linear / f32_linear (panels);
    # "onednn": torch.ops.mkldnn._linear_pointwise;
    # "int8" / "w8a8": services/worker/models/int8.py (data int8, `scale` fp32 per row);
    # "triton_int8" / "triton_w8a8": the same on CUDA, data q [out, in] for
    # pagoda_kernels/triton/int8_matmul.py
    data: torch.Tensor
    out_features: int
    gate_up: bool = False  # [gate; up] packed so that the matmul returns SiLU(gate) * up
    scale: torch.Tensor | None = None
    weight_sums: torch.Tensor | None = None  # int8 / w8a8: each row's sum of q, int32
    gguf: GGUFWeight | None = None  # "gguf": the blocks (models/gguf_weights.py)


def _onednn(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear, with bf16 instructions on this CPU for bf16 (else emulated)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported()
    return dtype == torch.float32


log = get_logger("worker")

_fp32_layout: str | None = None  # fp32_layout's answer, once measured (or set)
# In order of preference when timed alike: panels let the C layer blocks run and fuse SiLU * up;
# [in, out] keeps the weight on huge pages without an opaque copy.
FP32_LAYOUTS = ("panels", "transposed", "onednn")
# How much faster (in time) a later layout must be to displace the one chosen before it. The
# panels' margin is wider: they also let the C layer blocks run (SiLU * up and the norms fused,
# a decode step in one call), which a bare matmul's time does not show. On a Zen 4 oneDNN timed
# 13% ahead of the panels on this product, and the engine ran 11% faster on the panels
# (64 x 128 -> 128 offline, fp32: 23.1 s against 25.9).
_DISPLACE = {"panels": 0.75, "transposed": 0.9}


def set_fp32_layout(layout: str | None) -> None:
    """Keep fp32 layer weights as `layout` (one of FP32_LAYOUTS) from now on, or (None) measure
    which again; for comparing them on one machine. Applies to weights packed afterwards."""
    global _fp32_layout
    if layout is not None and layout not in FP32_LAYOUTS:
        raise ValueError(f"fp32 layout must be one of {FP32_LAYOUTS}, got {layout!r}")
    _fp32_layout = layout


def faster_fp32_layout(seconds: dict[str, float]) -> str:
    """The layout to keep given each one's time: a layout later in FP32_LAYOUTS only where it
    is clearly faster than the one chosen before it (by 25% for the panels, else 10%)."""
    chosen = None
    for layout in FP32_LAYOUTS:
        if layout in seconds and (chosen is None
                                  or seconds[layout] < _DISPLACE[chosen] * seconds[chosen]):
            chosen = layout
    if chosen is None:
        raise ValueError(f"no time for any fp32 layout: {seconds}")
    return chosen


def fastest_times(runs: dict[str, Callable[[], object]], rounds: int = 7) -> dict[str, float]:
    """Each run's fastest time (s) of `rounds`, the runs taking turns within every round: this
    CPU's speed drifts within seconds (the first calls after start-up most), and timing one
    candidate after another let the drift pick the winner (4-row panels over 6-row ones, and
    oneDNN over both, on a CPU where both came out the other way round a minute later)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # first calls: thread pool, page faults
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def fp32_layout() -> str:
    """How fp32 layer weights are kept on this CPU: "panels" (pagoda_kernels/cpu/matmul_f32.c, where
    it runs), "transposed" ([in, out] for MKL's sgemm) or "onednn" (oneDNN's packed matmul).
    Decided once per process by timing each on a decode-sized product (64 x 1024 x 1024, the
    fastest of 7 rounds in which the candidates take turns, ~0.1 s in all): which one wins
    depends on the CPU (MKL's sgemm ran at half oneDNN's rate at batch 64 on a Zen 4, and ahead
    of it on Xeons). The panels' block heights (`f32_block_rows`) are candidates of their own in
    the same rounds; the fastest height is kept for this process."""
    global _fp32_layout
    if _fp32_layout is None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 1024, generator=g)
        weight = torch.randn(1024, 1024, generator=g)
        runs: dict[str, Callable[[], object]] = {
            "transposed": partial(F.linear, x, weight.t().contiguous().t())}
        panels = cpu_kernels.pack_f32_weight(weight)
        if panels is not None:
            def panels_of(rows: int) -> object:
                cpu_kernels.set_f32_block_rows(rows)
                return cpu_kernels.f32_linear(x, panels, None, 1024)
            for rows in cpu_kernels.f32_block_rows():
                runs[f"panels/{rows}"] = partial(panels_of, rows)
        if _onednn(torch.float32):
            runs["onednn"] = partial(torch.ops.mkldnn._linear_pointwise, x,
                                     torch.ops.mkldnn._reorder_linear_weight(weight, 64), None,
                                     "none", [], "")
        seconds = fastest_times(runs)
        block_rows = None
        if panels is not None:
            by_rows = {rows: seconds.pop(f"panels/{rows}")
                       for rows in cpu_kernels.f32_block_rows()}
            block_rows = min(by_rows, key=by_rows.get)
            cpu_kernels.set_f32_block_rows(block_rows)
            seconds["panels"] = by_rows[block_rows]
        _fp32_layout = faster_fp32_layout(seconds)
        log.info("fp32 weight layout timed", layout=_fp32_layout, block_rows=block_rows,
                 ms={name: round(t * 1e3, 3) for name, t in seconds.items()})
    return _fp32_layout


def pack_weight(weight: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
                gate_up: bool = False, quantization: str | None = None) -> PackedWeight | None:
    """The weight [out, in] packed for the fastest kernel that takes it, if its dtype is one of
    `dtypes` and it is on the CPU; None otherwise. `gate_up` asks for the fused SiLU(gate) * up
    where the kernel has it (see `PackedWeight.gate_up` for whether it was given).
    `quantization="int8"` or `"w8a8"` quantizes a CPU weight of any dtype instead; a CUDA
    weight (or any, with int8.TRITON_INT8 forced) becomes int8 rows and scales on its device
    for the Triton kernels (SiLU * up after the matmul: `gate_up` is not fused there)."""
    out_features = weight.shape[0]
    if quantization in QUANTIZATIONS and triton_int8_for(weight):
        q, scale = quantize_rows(weight)
        return PackedWeight(f"triton_{quantization}", q, out_features, False, scale)
    if quantization in QUANTIZATIONS and weight.device.type == "cpu":
        data, scale, sums, fused = quantize_weight(weight, gate_up, quantization == "w8a8")
        return PackedWeight(quantization, data, out_features, fused, scale, sums)
    if weight.device.type != "cpu" or weight.dtype not in dtypes:
        return None
    # On huge pages: a step streams it from memory (services/worker/host_memory.py).
    if weight.dtype == torch.float32:
        panels = (cpu_kernels.pack_f32_weight(weight, gate_up, empty=host_empty)
                  if fp32_layout() == "panels" else None)
    else:
        panels = cpu_kernels.pack_bf16_weight(weight, gate_up, empty=host_empty)
    if panels is not None:
        return PackedWeight("bf16" if weight.dtype == torch.bfloat16 else "f32", panels,
                            out_features, gate_up)
    if not _onednn(weight.dtype):
        return None
    return PackedWeight("onednn", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64),
                        out_features)


def drop_plain_weight(module: nn.Module) -> None:
    """Replace `module.weight` by a meta tensor of the same shape and dtype once a packed copy
    does its work, so the weight is not held twice."""
    weight = module.weight
    module.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """x W^T (+ b); for a `gate_up` packed weight, SiLU(gate) * up of that."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.kind == "bf16":
        return cpu_kernels.bf16_linear(x, packed.data, bias, packed.out_features, packed.gate_up)
    if packed.kind == "f32":
        return cpu_kernels.f32_linear(x, packed.data, bias, packed.out_features, packed.gate_up)
    # (Quantized: on the plain step's path in a speculative step, models/plain_rows.py.)
    if packed.kind == "gguf":
        return in_pieces(gguf_linear, x, max_rows("gguf", x), packed.gguf, bias)
    if packed.kind in TRITON_QUANTIZATIONS:
        return triton_int8_linear(x, packed.data, packed.scale, bias,
                                  packed.kind == "triton_w8a8")
    if packed.kind in QUANTIZATIONS:
        return in_pieces(int8_linear, x, max_rows("int8", x), packed.data, packed.scale,
                         packed.weight_sums, bias, packed.out_features, weight.shape[1],
                         packed.gate_up, packed.kind == "w8a8")
    return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")


class Linear(nn.Module):
    """y = x W^T (+ b). Left uninitialised: `load_weights` fills every parameter."""

    gate_up = False  # a [gate; up] weight whose output is SiLU(gate) * up (SiluAndMulLinear)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.packed: PackedWeight | None = None  # set by `pack` once the weight is loaded

    def pack(self, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
             quantization: str | None = None) -> None:
        weight = self.weight
        if (quantization is None and weight.device.type == "cpu"
                and weight.dtype == torch.float32 and torch.float32 not in dtypes
                and fp32_layout() in ("panels", "onednn")):
            dtypes = (*dtypes, torch.float32)
        self.packed = pack_weight(weight, dtypes, gate_up=self.gate_up, quantization=quantization)
        if self.packed is not None:
            drop_plain_weight(self)
        elif weight.device.type == "cpu" and weight.dtype == torch.float32:
            weight.data = host_copy(weight.data.t()).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class SiluAndMulLinear(Linear):
    """The gate and up projections as one weight [gate; up], returning SiLU(x Wg^T) * (x Wu^T):
    in the matmul's epilogue with the bf16 or fp32 panels and the int8 kernels (the
    [T, 2 * intermediate] product is never written), after it otherwise."""

    gate_up = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and self.packed.gate_up:
            return linear(x, self.weight, self.bias, self.packed)
        gate_up = linear(x, self.weight, self.bias, self.packed)
        if (self.packed is not None and self.packed.kind == "gguf" and gate_up.dim() == 2
                and cpu_kernels.available_for(gate_up)):
            # As the layer blocks compute it (pagoda_kernels/cpu/blocks.c), so that a GGUF model gives
            # the same numbers either way: its activations are quantized to 8 bits at every
            # matmul, where a last-bit difference can move a value across a rounding step.
            return cpu_kernels.silu_mul(gate_up)
        # torch's two vectorised ops here are as fast as a fused C loop (pagoda bench kernels).
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
