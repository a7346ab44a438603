"""The kernels section: every Triton kernel of pagoda_kernels/triton against its torch reference on the
device, then timed at realistic shapes (kernel_timing.py)."""
import contextlib

from .int8_checks import check_int8_matmuls, time_int8_matmuls
from .kernel_inputs import (kv_write_inputs, norm_inputs, paged_cache, prefill_inputs,
                            rotary_inputs, rotary_table)
from .kernel_timing import time_decode_attention, time_elementwise, time_prefill_attention
from .measure import device_generator, guarded_row, guarded_rows
from .report import Row, Run, log
from .sampling_checks import check_top_k_top_p, time_top_k_top_p

# Tolerances of tests/test_triton_attention.py against the fp32 reference.
ATTENTION_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def section_kernels(run: Run, device) -> list:
    import torch
    rows = []
    run.raw["kernels"] = raw = {}
    dtype = torch.bfloat16
    for name, check in (("paged_decode_attention", check_decode_attention),
                        ("prefill_attention", check_prefill_attention),
                        ("write_kv_cache", check_write_kv_cache),
                        ("rms_norm", check_rms_norm), ("rotary_", check_rotary),
                        ("top_k_top_p", check_top_k_top_p),
                        ("int8_linear / w8a8_linear", check_int8_matmuls)):
        rows.append(guarded_row(run, "kernels", f"{name}: correctness",
                                lambda check=check: check(run, device, dtype)))
    rows += guarded_rows(run, "kernels", "decode attention: timing",
                         lambda: time_decode_attention(run, device, dtype, raw))
    rows += guarded_rows(run, "kernels", "prefill attention: timing",
                         lambda: time_prefill_attention(run, device, dtype, raw))
    rows += guarded_rows(run, "kernels", "element-wise kernels: timing",
                         lambda: time_elementwise(run, device, dtype, raw))
    rows += guarded_rows(run, "kernels", "top-k / top-p: timing",
                         lambda: time_top_k_top_p(run, device, dtype, raw))
    rows += guarded_rows(run, "kernels", "int8 / w8a8 matmuls: timing",
                         lambda: time_int8_matmuls(run, device, dtype, raw))
    return rows


def attention_verdict(out, expected, dtype) -> tuple[str, str]:
    """(result, verdict) of an attention output against the fp32 reference."""
    import torch
    tol = ATTENTION_TOLERANCE[str(dtype).removeprefix("torch.")]
    out, expected = out.float(), expected.float()
    written = not torch.isnan(out).any().item()
    err = (out - expected).abs().max().item()
    ok = written and torch.allclose(out, expected, atol=tol, rtol=tol)
    result = f"max abs error {err:.2e} vs the fp32 reference" + ("" if written else
                                                                 ", NaN left in the output")
    return result, "ok" if ok else "MISMATCH"


def check_decode_attention(run: Run, device, dtype) -> Row:
    import torch
    from pagoda_kernels import reference
    from pagoda_kernels.triton.paged_attention import paged_decode_attention
    p = run.plan
    g = device_generator(device, 1)
    lens = p.decode_check_lens
    k, v, tables, seq_lens = paged_cache(lens, p.num_kv_heads, p.head_dim, p.block_size,
                                         dtype, device, g)
    q = torch.randn(len(lens), p.num_heads, p.head_dim, generator=g, device=device).to(dtype)
    scale = p.head_dim ** -0.5
    expected = reference.paged_decode_attention(q.float(), k.float(), v.float(), tables,
                                                seq_lens, max(lens), scale)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, tables, seq_lens, max(lens), scale, out=out)
    result, verdict = attention_verdict(out, expected, dtype)
    shape = (f"{len(lens)} seqs of {min(lens)}-{max(lens)} tokens, {p.num_heads}/"
             f"{p.num_kv_heads} heads, head_dim {p.head_dim}, block {p.block_size}")
    log(run, f"kernels: decode attention check ({shape}): {result}")
    return Row("kernels", "paged_decode_attention: correctness", f"{result} ({shape})",
               f"allclose at {ATTENTION_TOLERANCE['bfloat16']}", verdict)


def check_prefill_attention(run: Run, device, dtype) -> Row:
    import torch
    from pagoda_kernels import reference
    from pagoda_kernels.triton.prefill_attention import prefill_attention
    p = run.plan
    g = device_generator(device, 2)
    query_lens, context_lens = p.prefill_check
    inputs = prefill_inputs(p, query_lens, context_lens, dtype, device, g)
    q, k, v, tables, starts, contexts, seq_lens, max_q, max_seq, scale = inputs
    expected = reference.prefill_attention(q.float(), k.float(), v.float(), tables, starts,
                                           contexts, seq_lens, max_q, max_seq, scale)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k, v, tables, starts, contexts, seq_lens, max_q, max_seq, scale,
                      out=out)
    result, verdict = attention_verdict(out, expected, dtype)
    shape = f"chunks of {query_lens} tokens over cached {context_lens}"
    log(run, f"kernels: prefill attention check ({shape}): {result}")
    return Row("kernels", "prefill_attention: correctness", f"{result} ({shape})",
               f"allclose at {ATTENTION_TOLERANCE['bfloat16']}", verdict)


def check_write_kv_cache(run: Run, device, dtype) -> Row:
    import torch
    from pagoda_kernels import reference
    from pagoda_kernels.triton.kv_cache import write_kv_cache
    p = run.plan
    g = device_generator(device, 3)
    key, value, key_cache, value_cache, slots = kv_write_inputs(p, dtype, device, g)
    padded = slots.clone()
    padded[1::3] = -1  # padding tokens: the kernel skips them, the reference is not given them
    valid = padded >= 0
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.write_kv_cache(key[valid], value[valid], expected_k, expected_v, padded[valid])
    write_kv_cache(key, value, key_cache, value_cache, padded)
    equal = torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    result = ("bit-exact against pagoda_kernels.reference" if equal else "differs from the reference")
    result += f" ({p.elementwise_tokens} tokens, every third one padding)"
    log(run, f"kernels: kv cache write check: {result}")
    return Row("kernels", "write_kv_cache: correctness", result, "bit-exact",
               "ok" if equal else "MISMATCH")


@contextlib.contextmanager
def model_torch_path():
    """The model's modules on their torch code: the compiled CPU kernels (which would take CPU
    tensors in the smoke mode) and the Triton kernels (which take CUDA tensors) switched off
    meanwhile."""
    from pagoda_kernels import cpu
    from services.worker.models import llama
    saved = cpu.available_for, llama.TRITON_ELEMENTWISE
    cpu.available_for = lambda x: False
    llama.TRITON_ELEMENTWISE = False
    try:
        yield
    finally:
        cpu.available_for, llama.TRITON_ELEMENTWISE = saved


def bf16_ulps(a, b):
    """How many bfloat16 values lie between a and b, elementwise."""
    import torch

    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def check_rms_norm(run: Run, device, dtype) -> Row:
    import torch
    from pagoda_kernels.triton.norm import rms_norm
    from services.worker.models.llama import RMSNorm
    p = run.plan
    g = device_generator(device, 4)
    x, residual, weight = norm_inputs(p, dtype, device, g)
    norm = RMSNorm(p.hidden, 1e-5, dtype).to(device)
    norm.weight.data.copy_(weight)
    with model_torch_path():
        expected, expected_residual = norm(x, residual.clone())
    got, got_residual = rms_norm(x, weight, 1e-5, residual)
    # As tests/test_triton_elementwise.py: the residual sum exact, the output within one bf16
    # step on rare elements (the sum of squares is added in another order than torch's).
    ulps = bf16_ulps(got, expected)
    off = (ulps > 0).sum().item()
    ok = (torch.equal(got_residual, expected_residual) and ulps.max().item() <= 1
          and off <= max(1, got.numel() // 2000))
    result = (f"residual bit-exact: {torch.equal(got_residual, expected_residual)}; output: "
              f"{off} of {got.numel()} values off, at most {ulps.max().item()} bf16 step(s)")
    log(run, f"kernels: rms_norm check: {result}")
    return Row("kernels", "rms_norm (+ residual): correctness", result,
               "<= 1 bf16 step on <= 1/2000 of values", "ok" if ok else "MISMATCH")


def check_rotary(run: Run, device, dtype) -> Row:
    from pagoda_kernels.triton.rotary import rotary_
    p = run.plan
    g = device_generator(device, 5)
    max_positions = 8192
    rotary = rotary_table(p, max_positions, dtype, device)
    _, qk, positions = rotary_inputs(p, max_positions, dtype, device, g)
    with model_torch_path():
        expected = rotary(positions, qk)  # the torch path returns a new tensor
    rotary_(qk, positions, rotary.cos_sin)
    off = (qk != expected).sum().item()
    result = ("bit-exact against RotaryEmbedding's torch path" if off == 0 else
              f"{off} of {qk.numel()} values differ, at most "
              f"{bf16_ulps(qk, expected).max().item()} bf16 step(s)")
    log(run, f"kernels: rotary check: {result}")
    return Row("kernels", "rotary_: correctness", result, "bit-exact (bf16)",
               "ok" if off == 0 else "MISMATCH")
