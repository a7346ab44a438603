"""The Triton kernels timed at realistic shapes: achieved GB/s (the bytes each op must read and
write) and the fraction of the copy bandwidth; TFLOP/s for prefill attention."""
import functools

from .kernel_inputs import (kv_write_inputs, norm_inputs, prefill_inputs, rotary_inputs,
                            rotary_table)
from .measure import device_generator, median_seconds
from .plan import DECODE_TARGET, LONG_CONTEXT
from .report import Row, Run, fraction_of_copy, log, num


def time_decode_attention(run: Run, device, dtype, raw: dict) -> list:
    """Every (batch, context) of the plan, all sequences at the full context, their blocks
    shuffled through one cache sized for the largest case."""
    import torch
    from pagoda_kernels.triton.paged_attention import paged_decode_attention
    p = run.plan
    elt = torch.finfo(dtype).bits // 8
    max_blocks = max(p.decode_batches) * -(-max(p.decode_contexts) // p.block_size)
    shape = (max_blocks, p.block_size, p.num_kv_heads, p.head_dim)
    key_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    value_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    log(run, f"kernels: decode timing cache {2 * key_cache.numel() * elt / 2**30:.1f} GiB")
    rows, raw["decode"] = [], []
    for batch in p.decode_batches:
        for context in p.decode_contexts:
            blocks = -(-context // p.block_size)
            tables = torch.randperm(batch * blocks, device=device).view(batch, blocks)
            seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
            q = torch.randn(batch, p.num_heads, p.head_dim, dtype=dtype, device=device)
            out = torch.empty_like(q)
            scale = p.head_dim ** -0.5
            seconds = median_seconds(
                lambda: paged_decode_attention(q, key_cache, value_cache, tables, seq_lens,
                                               context, scale, out=out),
                device, p.timing_iters, p.warmup)
            # K and V of every token, the query read and the output written (the partials of a
            # split context and the block table are the kernel's overhead, not counted).
            num_bytes = (2 * batch * context * p.num_kv_heads * p.head_dim * elt
                         + 2 * q.numel() * elt)
            rate = num_bytes / seconds
            long = context >= LONG_CONTEXT
            fraction = rate / run.copy_bytes_per_s if run.copy_bytes_per_s else None
            verdict = ("" if not long or fraction is None else
                       "ok" if fraction >= DECODE_TARGET else "below target")
            raw["decode"].append(dict(batch=batch, context=context, seconds=seconds,
                                      bytes=num_bytes, bytes_per_s=rate, fraction=fraction))
            result = (f"{seconds * 1e3:.3f} ms, {num(rate / 1e9)} GB/s, "
                      f"{fraction_of_copy(run, rate)}")
            log(run, f"kernels: decode batch {batch} context {context}: {result}")
            rows.append(Row("kernels", f"decode attention, batch {batch}, context {context:,}",
                            result, f">= {DECODE_TARGET:.0%} of copy" if long else "",
                            verdict))
    return rows


def time_prefill_attention(run: Run, device, dtype, raw: dict) -> list:
    """Attention FLOPs over the query/key pairs each chunk sees (QK^T and PV, 4 * head_dim per
    pair and head), at the measured matmul rate."""
    import torch
    from pagoda_kernels.triton.prefill_attention import prefill_attention
    p = run.plan
    g = device_generator(device, 6)
    rows, raw["prefill"] = [], []
    for query_lens, context_lens in p.prefill_timings:
        inputs = prefill_inputs(p, query_lens, context_lens, dtype, device, g)
        out = torch.empty_like(inputs[0])
        seconds = median_seconds(functools.partial(prefill_attention, *inputs, out=out),
                                 device, p.timing_iters, p.warmup)
        pairs = sum(q * c + q * (q + 1) // 2 for q, c in zip(query_lens, context_lens))
        flops = 4 * p.num_heads * p.head_dim * pairs
        rate = flops / seconds
        share = (f", {rate / run.matmul_flop_per_s:.0%} of the matmul rate"
                 if run.matmul_flop_per_s else "")
        label = (f"{len(query_lens)} x {query_lens[0]} tokens"
                 + (f" over {context_lens[0]:,} cached" if any(context_lens) else ""))
        raw["prefill"].append(dict(query_lens=query_lens, context_lens=context_lens,
                                   seconds=seconds, flops=flops, flop_per_s=rate))
        result = f"{seconds * 1e3:.3f} ms, {num(rate / 1e12)} TFLOP/s{share}"
        log(run, f"kernels: prefill {label}: {result}")
        rows.append(Row("kernels", f"prefill attention, {label}", result))
        del inputs, out
    return rows


def time_elementwise(run: Run, device, dtype, raw: dict) -> list:
    """The KV cache write, RMSNorm with the residual add and rotary at a prefill step's token
    count, each by the bytes it must read and write."""
    import torch
    from pagoda_kernels.triton.kv_cache import write_kv_cache
    from pagoda_kernels.triton.norm import rms_norm
    from pagoda_kernels.triton.rotary import rotary_
    p = run.plan
    g = device_generator(device, 7)
    elt = torch.finfo(dtype).bits // 8
    tokens = p.elementwise_tokens
    cases = []

    key, value, key_cache, value_cache, slots = kv_write_inputs(p, dtype, device, g)
    kv_bytes = 4 * key.numel() * elt + slots.numel() * 8  # k, v read and written; slots read
    cases.append(("write_kv_cache", f"{tokens} tokens x {p.num_kv_heads} kv heads",
                  lambda: write_kv_cache(key, value, key_cache, value_cache, slots), kv_bytes))

    x, residual, weight = norm_inputs(p, dtype, device, g)
    out = torch.empty_like(x)
    norm_bytes = 4 * x.numel() * elt + weight.numel() * elt  # x, residual in; residual, out
    cases.append(("rms_norm + residual", f"{tokens} x {p.hidden}",
                  lambda: rms_norm(x, weight, 1e-5, residual, out=out), norm_bytes))

    rotary = rotary_table(p, 8192, dtype, device)
    _, qk, positions = rotary_inputs(p, 8192, dtype, device, g)
    # q|k read and written in place, each token's cos/sin rows read.
    rotary_bytes = 2 * qk.numel() * elt + tokens * 2 * p.head_dim * elt + tokens * 8
    cases.append(("rotary_", f"{tokens} tokens x {p.num_heads + p.num_kv_heads} heads",
                  lambda: rotary_(qk, positions, rotary.cos_sin), rotary_bytes))

    rows, raw["elementwise"] = [], []
    for name, shape, fn, num_bytes in cases:
        seconds = median_seconds(fn, device, p.timing_iters, p.warmup)
        rate = num_bytes / seconds
        raw["elementwise"].append(dict(name=name, shape=shape, seconds=seconds,
                                       bytes=num_bytes, bytes_per_s=rate))
        result = (f"{seconds * 1e6:,.1f} us, {num(rate / 1e9)} GB/s, "
                  f"{fraction_of_copy(run, rate)}")
        log(run, f"kernels: {name} ({shape}): {result}")
        rows.append(Row("kernels", f"{name}, {shape}", result))
    return rows
