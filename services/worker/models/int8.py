"""Weight-only int8 matmul weights (`--quantization int8`), for the CPU.

Each weight [out, in] is kept as int8 `q` with one scale per output row, `s = max|w_row| / 127`
(symmetric, no zero point, s rounded to bf16), so that w ~ q * s[:, None]; only q and s stay in
memory (half of bf16, a quarter of fp32). Two ways to multiply, by the number of rows:
- up to `KERNEL_MAX_ROWS` (decode steps): torch's weight-only int8 CPU kernel,
  `torch._weight_int8pack_mm(x, q, s)`, which widens the int8 weights as it reads them. Only its
  bf16 path is vectorised (fp32 ran 20-60x slower than the bf16 one, measured), so other
  activations are rounded to bf16 for it and its output converted back;
- more rows (prompts): the kernel's time grows with the rows (it streams the weight once per
  few rows), so the weight is dequantized into a temporary of the activation dtype, which the
  dense matmul then reads; at ~20 rows the two cost the same (measured, 576 x 1536, 2 threads).
A bias is added after the product.
"""
import torch
import torch.nn.functional as F

from services.worker.host_memory import host_copy

KERNEL_MAX_ROWS = 20

# torch 2.13's bf16 path of the kernel reads past the end of rows whose length is not a multiple
# of 16 (a crash, not an error): such weights get zero columns up to it, and the kernel's inputs
# are padded with zeros to match.
_K_MULTIPLE = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU weight [out, in] -> (q [out, in'] int8, s [out] bf16), in' = in rounded up to a
    multiple of 16 with zero columns. q is rounded against s as stored, so q * s is the weight
    both ways of multiplying use."""
    w = weight.detach().float()  # one tensor at a time: the only fp32 copy made
    scale = (w.abs().amax(dim=1) / 127.0).bfloat16().float()
    # An all-zero row: any scale gives q = 0; 1 avoids 0 / 0.
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    del w
    pad = -q.shape[1] % _K_MULTIPLE
    if pad:
        q = F.pad(q, (0, pad))
    # On huge pages, like the other packed weights: a step streams it from memory.
    return host_copy(q), scale.bfloat16()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] (q * s[:, None])^T (+ b), in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > KERNEL_MAX_ROWS:
        weight = q[:, :k].to(x.dtype).mul_(scale.to(x.dtype)[:, None])
        out = F.linear(x2, weight, bias)
    else:
        xb = x2.to(torch.bfloat16)
        if xb.stride(-1) != 1:
            xb = xb.contiguous()  # the kernel reads rows with unit stride
        if q.shape[1] != k:  # the zero columns of a padded weight
            xb = F.pad(xb, (0, q.shape[1] - k))
        out = torch._weight_int8pack_mm(xb, q, scale).to(x.dtype)
        if bias is not None:
            out += bias
    return out.view(*lead, out.shape[-1])
