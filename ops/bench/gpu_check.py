"""The GPU check: one run on a GPU machine that measures what docs/benchmarks.md's "GPU check
(H200)" section asks for, and prints one table (also written as gpu_check.json and gpu_check.md
under $OUT, or ops/results/ when OUT is unset, after every section).

Sections, each catching its own errors (a failed one is a FAILED row, the rest still run):
  env         the GPU, torch / triton / transformers versions, the device-to-device copy
              bandwidth (bytes read + written, median of many runs) and the bf16 matmul rate;
              the ceilings everything below is measured against
  kernels     every Triton kernel of kernels/triton against its torch reference on the GPU, then
              timed at realistic shapes: achieved GB/s (bytes the op must read and write) and
              the fraction of the copy bandwidth (TFLOP/s for prefill attention)
  parity      greedy tokens of the whole engine (`pagoda.LLM`) against transformers on small
              random Llama and Qwen2 models, fp32 and bf16; a divergence passes only at a
              near-tie (each side's token in the other's top 5 there)
  throughput  offline throughput with random weights at the Llama-3.2-1B and Llama-3.1-8B
              shapes (bf16, ignore_eos) against transformers' static batching in the same run
              and against a roofline built from the two measured ceilings
  serve       `pagoda serve --device cuda` under `pagoda bench serve` on the 1B random model:
              output tok/s, TTFT, TPOT (skipped when the wheels it needs are missing)

`--device cpu` is the smoke mode: tiny shapes and models, the kernels under Triton's interpreter
(TRITON_INTERPRET=1, set here when missing), no serve; it exercises the same code paths.
A watchdog prints the table and exits once `--deadline-s` has passed, so a run cut short by an
outer time limit still reports what it measured.

    python -m ops.bench.gpu_check [--quick] [--skip-serve] ...   # ops/gpu_check.sh on a GPU
"""
import argparse
import contextlib
import gc
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import asdict, dataclass, field, replace

# The targets docs/benchmarks.md states.
DECODE_TARGET = 0.70  # of the copy bandwidth, decode attention at long contexts
LONG_CONTEXT = 16384  # contexts from here on count as long
SPEEDUP_TARGET = 5.0  # over transformers' static batching, 8B shape
ROOFLINE_TARGET = 0.50  # of the roofline, 8B shape
TOP_K = 5  # near-tie allowance of the parity checks

# Llama-3.2-1B and Llama-3.1-8B as published (LlamaConfig kwargs); the weights are random.
LLAMA_3_2_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192))
LLAMA_3_1_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192))
# The smoke mode's stand-in (tests/helpers.py's tiny Llama).
TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
    tie_word_embeddings=False)


# --- what a run measures ---------------------------------------------------------------------

@dataclass
class ModelSpec:
    name: str
    config: dict  # LlamaConfig kwargs
    num_prompts: int
    input_len: int
    output_len: int
    hf_prompts: int  # transformers runs this many of the prompts (its rate does not depend on it)
    hf_batch_size: int
    has_targets: bool  # the speedup and roofline targets are stated for this shape


@dataclass
class Plan:
    device: str
    # env
    copy_bytes: int
    matmul_n: int
    env_iters: int
    # kernels
    timing_iters: int
    warmup: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_batches: list
    decode_contexts: list
    decode_check_lens: list  # sequence lengths of the correctness check
    prefill_check: tuple  # (query_lens, context_lens)
    prefill_timings: list  # [(query_lens, context_lens)]
    elementwise_tokens: int
    hidden: int
    # parity
    parity_cases: list  # [(architecture, dtype name)]
    parity_config: dict  # size of the random models (config kwargs)
    parity_prompt_lens: list
    parity_new_tokens: int
    # throughput and serve
    models: list  # [ModelSpec]
    serve: bool
    serve_prompts: int
    serve_input_len: int
    serve_output_len: int
    # every LLM of the run gets these
    engine_kwargs: dict = field(default_factory=dict)
    # a section starts only with this many seconds left before the deadline
    min_left_s: dict = field(default_factory=dict)


def cuda_plan(quick: bool) -> Plan:
    one_b = ModelSpec("1B", LLAMA_3_2_1B, 512, 512, 256, 128, 64, False)
    eight_b = ModelSpec("8B", LLAMA_3_1_8B, 512, 512, 256, 64, 64, True)
    if quick:
        one_b = replace(one_b, num_prompts=128, input_len=256, output_len=64, hf_prompts=64)
        eight_b = replace(eight_b, num_prompts=128, input_len=256, output_len=64)
    return Plan(
        device="cuda", copy_bytes=2 << 30, matmul_n=8192, env_iters=30,
        timing_iters=50, warmup=5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        decode_batches=[64, 256],
        decode_contexts=[4096, 32768] if quick else [1024, 4096, 16384, 32768],
        decode_check_lens=[1, 17, 511, 513, 4000, 16384, 32765],
        prefill_check=([1, 300, 1024, 77], [4000, 0, 2048, 513]),
        prefill_timings=[([2048] * 8, [0] * 8), ([512] * 4, [16384] * 4)],
        elementwise_tokens=16384, hidden=4096,
        parity_cases=([("llama", "float32"), ("qwen2", "bfloat16")] if quick else
                      [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"),
                       ("qwen2", "bfloat16")]),
        parity_config=dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                           max_position_embeddings=2048),
        parity_prompt_lens=[5, 37, 130, 600], parity_new_tokens=24,
        models=[one_b, eight_b], serve=True,
        serve_prompts=64 if quick else 256, serve_input_len=256 if quick else 512,
        serve_output_len=64 if quick else 128,
        min_left_s={"kernels": 45, "parity": 45, "throughput 1B": 75, "throughput 8B": 150,
                    "serve": 90})


def cpu_plan() -> Plan:
    tiny = ModelSpec("tiny", TINY_LLAMA, 6, 16, 6, 4, 4, False)
    return Plan(
        device="cpu", copy_bytes=64 << 20, matmul_n=256, env_iters=5,
        timing_iters=2, warmup=1, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
        decode_batches=[2], decode_contexts=[40, 600],  # 600: split over two partitions
        decode_check_lens=[1, 37, 600],
        prefill_check=([1, 9, 20], [17, 0, 30]),
        prefill_timings=[([16, 16], [0, 0])],
        elementwise_tokens=8, hidden=128,
        parity_cases=[("llama", "float32"), ("qwen2", "bfloat16")],
        parity_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                           max_position_embeddings=512),
        parity_prompt_lens=[5, 23], parity_new_tokens=6,
        models=[tiny], serve=False, serve_prompts=4, serve_input_len=8, serve_output_len=4,
        # The Triton kernels in the engine too (interpreted), so the smoke run reaches them.
        engine_kwargs=dict(attention_backend="triton"))


@dataclass
class Row:
    section: str
    check: str
    result: str
    target: str = ""
    verdict: str = ""  # ok, below target, MISMATCH, FAILED, skipped; "" for a plain reading


@dataclass
class Run:
    plan: Plan
    args: argparse.Namespace
    results_dir: str
    work_dir: str  # model folders and logs, removed at the end
    started: float = field(default_factory=time.monotonic)
    rows: list = field(default_factory=list)
    raw: dict = field(default_factory=dict)  # per section: the numbers behind its rows
    meta: dict = field(default_factory=dict)
    copy_bytes_per_s: float | None = None
    matmul_flop_per_s: float | None = None
    section: str | None = None  # the one running now
    children: list = field(default_factory=list)  # processes to stop at any exit
    folders: dict = field(default_factory=dict)  # model name -> saved folder
    pending: list = field(default_factory=list)  # sections not started yet
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False


def log(run: Run, message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - run.started:6.1f}s] {message}",
          flush=True)


# --- timing and memory -----------------------------------------------------------------------

def synchronize(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, iters: int, warmup: int) -> float:
    """Median time of one call of fn. On CUDA from events around each call, queued behind a
    short device-side sleep so that the host's launch cost does not show in the kernel's time
    (the calls then run back to back); on the CPU from the wall clock."""
    import torch
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(2e6 * min(50.0, 0.3 * iters)))  # ~cycles at ~2 GHz: ms
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def free_device_memory(device) -> None:
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def num(x: float) -> str:
    """Thousands separators for large numbers, three significant digits for small ones (the
    smoke mode's rates)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def fraction_of_copy(run: Run, bytes_per_s: float) -> str:
    if not run.copy_bytes_per_s:
        return "n/a (no copy bandwidth)"
    return f"{bytes_per_s / run.copy_bytes_per_s:.0%} of copy"


# --- env -------------------------------------------------------------------------------------

def section_env(run: Run, device) -> list:
    import torch
    import triton
    import transformers
    plan = run.plan
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = (f"{props.name}, {props.multi_processor_count} SMs, "
               f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    else:
        gpu = f"none (smoke mode on the CPU, {os.cpu_count()} cores)"
    versions = (f"torch {torch.__version__}, triton {triton.__version__}, transformers "
                f"{transformers.__version__}, Python {sys.version.split()[0]}")
    run.meta.update(gpu=gpu, versions=versions)
    log(run, f"env: {gpu}; {versions}")

    copy_s = copy_seconds(device, plan.copy_bytes, plan.env_iters)
    run.copy_bytes_per_s = 2 * plan.copy_bytes / copy_s  # read + written
    log(run, f"env: copy of {plan.copy_bytes / 2**30:.2f} GiB in {copy_s * 1e3:.3f} ms: "
             f"{num(run.copy_bytes_per_s / 1e9)} GB/s")
    n = plan.matmul_n
    matmul_s = matmul_seconds(device, n, plan.env_iters)
    run.matmul_flop_per_s = 2 * n ** 3 / matmul_s
    log(run, f"env: bf16 matmul {n}^3 in {matmul_s * 1e3:.3f} ms: "
             f"{num(run.matmul_flop_per_s / 1e12)} TFLOP/s")
    run.raw["env"] = dict(gpu=gpu, versions=versions, copy_bytes=plan.copy_bytes,
                          copy_s=copy_s, copy_bytes_per_s=run.copy_bytes_per_s, matmul_n=n,
                          matmul_s=matmul_s, matmul_flop_per_s=run.matmul_flop_per_s)
    return [
        Row("env", "device", gpu),
        Row("env", "software", versions),
        Row("env", "copy bandwidth (device to device)",
            f"{num(run.copy_bytes_per_s / 1e9)} GB/s read + written "
            f"({plan.copy_bytes / 2**30:.2f} GiB copy_, median of {plan.env_iters})"),
        Row("env", f"bf16 matmul {n}x{n}x{n}",
            f"{num(run.matmul_flop_per_s / 1e12)} TFLOP/s (random data, median of "
            f"{plan.env_iters})"),
    ]


def copy_seconds(device, num_bytes: int, iters: int) -> float:
    import torch
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, iters, warmup=3)
    del src, dst
    free_device_memory(device)
    return seconds


def matmul_seconds(device, n: int, iters: int) -> float:
    import torch
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    seconds = median_seconds(lambda: torch.matmul(a, b, out=c), device, iters, warmup=3)
    del a, b, c
    free_device_memory(device)
    return seconds


# --- kernels ---------------------------------------------------------------------------------

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
                        ("rms_norm", check_rms_norm), ("rotary_", check_rotary)):
        rows.append(guarded_row(run, "kernels", f"{name}: correctness",
                                lambda check=check: check(run, device, dtype)))
    rows += guarded_rows(run, "kernels", "decode attention: timing",
                         lambda: time_decode_attention(run, device, dtype, raw))
    rows += guarded_rows(run, "kernels", "prefill attention: timing",
                         lambda: time_prefill_attention(run, device, dtype, raw))
    rows += guarded_rows(run, "kernels", "element-wise kernels: timing",
                         lambda: time_elementwise(run, device, dtype, raw))
    return rows


def guarded_row(run: Run, section: str, check: str, fn) -> Row:
    """fn() -> Row, or a FAILED row: one check's error does not end its section."""
    try:
        return fn()
    except Exception as e:  # reported in the table, the rest of the section goes on
        log(run, f"{section}: {check} FAILED: {type(e).__name__}: {e}")
        return Row(section, check, f"FAILED: {type(e).__name__}: {e}", verdict="FAILED")
    finally:
        free_device_memory(device_of(run))


def guarded_rows(run: Run, section: str, check: str, fn) -> list:
    try:
        return fn()
    except Exception as e:
        log(run, f"{section}: {check} FAILED: {type(e).__name__}: {e}")
        return [Row(section, check, f"FAILED: {type(e).__name__}: {e}", verdict="FAILED")]
    finally:
        free_device_memory(device_of(run))


def device_of(run: Run):
    import torch
    return torch.device(run.plan.device)


def device_generator(device, seed: int):
    """Random inputs drawn on the device itself: drawing gigabytes on the host takes long."""
    import torch
    return torch.Generator(device=device).manual_seed(seed)


def paged_cache(seq_lens: list, num_kv_heads: int, head_dim: int, block_size: int, dtype,
                device, generator):
    """A paged K/V cache holding sequences of `seq_lens` tokens at shuffled block ids (block 0
    left to the tables' padding) -> (key_cache, value_cache, block_tables, seq_lens)."""
    import torch
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    ids = (torch.randperm(num_blocks - 1, generator=generator, device=device) + 1).tolist()
    width = max(blocks_per_seq)
    rows = []
    for count in blocks_per_seq:
        row, ids = ids[:count], ids[count:]
        rows.append(row + [0] * (width - count))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    return (key_cache, value_cache, torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(seq_lens, dtype=torch.int64, device=device))


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
    from kernels import reference
    from kernels.triton.paged_attention import paged_decode_attention
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
    from kernels import reference
    from kernels.triton.prefill_attention import prefill_attention
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


def prefill_inputs(p: Plan, query_lens: list, context_lens: list, dtype, device, generator):
    """Everything prefill_attention takes, for chunks of `query_lens` tokens over cached
    prefixes of `context_lens` (their own K/V already in the cache)."""
    import torch
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    k, v, tables, lens = paged_cache(seq_lens, p.num_kv_heads, p.head_dim, p.block_size,
                                     dtype, device, generator)
    q = torch.randn(sum(query_lens), p.num_heads, p.head_dim,
                    generator=generator, device=device).to(dtype)
    starts = torch.tensor([0] + query_lens, dtype=torch.int64).cumsum(0).to(device)
    contexts = torch.tensor(context_lens, dtype=torch.int64, device=device)
    return (q, k, v, tables, starts, contexts, lens, max(query_lens), max(seq_lens),
            p.head_dim ** -0.5)


def check_write_kv_cache(run: Run, device, dtype) -> Row:
    import torch
    from kernels import reference
    from kernels.triton.kv_cache import write_kv_cache
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
    result = ("bit-exact against kernels.reference" if equal else "differs from the reference")
    result += f" ({p.elementwise_tokens} tokens, every third one padding)"
    log(run, f"kernels: kv cache write check: {result}")
    return Row("kernels", "write_kv_cache: correctness", result, "bit-exact",
               "ok" if equal else "MISMATCH")


def kv_write_inputs(p: Plan, dtype, device, generator):
    """key/value as slices of a fused qkv projection, caches with room to spare, a distinct
    random slot per token."""
    import torch
    tokens, kv_width = p.elementwise_tokens, p.num_kv_heads * p.head_dim
    qkv = torch.randn(tokens, p.num_heads * p.head_dim + 2 * kv_width,
                      generator=generator, device=device).to(dtype)
    _, k, v = qkv.split([p.num_heads * p.head_dim, kv_width, kv_width], dim=-1)
    num_blocks = -(-tokens // p.block_size) + 8
    shape = (num_blocks, p.block_size, p.num_kv_heads, p.head_dim)
    key_cache = torch.zeros(shape, dtype=dtype, device=device)
    value_cache = torch.zeros(shape, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * p.block_size, generator=generator, device=device)[:tokens]
    return (k.view(tokens, p.num_kv_heads, p.head_dim),
            v.view(tokens, p.num_kv_heads, p.head_dim), key_cache, value_cache, slots)


@contextlib.contextmanager
def model_torch_path():
    """The model's modules on their torch code, as on a GPU: the compiled CPU kernels (which
    would take CPU tensors in the smoke mode) switched off meanwhile."""
    from kernels import cpu
    saved = cpu.available_for
    cpu.available_for = lambda x: False
    try:
        yield
    finally:
        cpu.available_for = saved


def bf16_ulps(a, b):
    """How many bfloat16 values lie between a and b, elementwise."""
    import torch

    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def check_rms_norm(run: Run, device, dtype) -> Row:
    import torch
    from kernels.triton.norm import rms_norm
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


def norm_inputs(p: Plan, dtype, device, generator):
    import torch
    shape = (p.elementwise_tokens, p.hidden)
    x = (torch.randn(shape, generator=generator, device=device) * 2).to(dtype)
    residual = (torch.randn(shape, generator=generator, device=device) * 2).to(dtype)
    weight = (torch.rand(p.hidden, generator=generator, device=device) * 2).to(dtype)
    return x, residual, weight


def rotary_table(p: Plan, max_positions: int, dtype, device):
    """The model's RotaryEmbedding with Llama-3 scaling (inverse frequencies not a plain
    power)."""
    from services.worker.models.llama import RotaryEmbedding
    config = types.SimpleNamespace(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=1024))
    return RotaryEmbedding(config, p.head_dim, max_positions, dtype).to(device)


def rotary_inputs(p: Plan, max_positions: int, dtype, device, generator):
    """The q|k view of a fused qkv projection, and random positions."""
    import torch
    heads = p.num_heads + 2 * p.num_kv_heads
    qkv = (torch.randn(p.elementwise_tokens, heads * p.head_dim, generator=generator,
                       device=device) * 2).to(dtype)
    qk = qkv[:, :(p.num_heads + p.num_kv_heads) * p.head_dim].view(
        p.elementwise_tokens, p.num_heads + p.num_kv_heads, p.head_dim)
    positions = torch.randint(0, max_positions, (p.elementwise_tokens,), generator=generator,
                              device=device)
    return qkv, qk, positions


def check_rotary(run: Run, device, dtype) -> Row:
    import torch
    from kernels.triton.rotary import rotary_
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


def time_decode_attention(run: Run, device, dtype, raw: dict) -> list:
    """Every (batch, context) of the plan, all sequences at the full context, their blocks
    shuffled through one cache sized for the largest case."""
    import torch
    from kernels.triton.paged_attention import paged_decode_attention
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
    from kernels.triton.prefill_attention import prefill_attention
    p = run.plan
    g = device_generator(device, 6)
    rows, raw["prefill"] = [], []
    for query_lens, context_lens in p.prefill_timings:
        inputs = prefill_inputs(p, query_lens, context_lens, dtype, device, g)
        out = torch.empty_like(inputs[0])
        seconds = median_seconds(lambda: prefill_attention(*inputs, out=out), device,
                                 p.timing_iters, p.warmup)
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
    from kernels.triton.kv_cache import write_kv_cache
    from kernels.triton.norm import rms_norm
    from kernels.triton.rotary import rotary_
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


# --- random models ---------------------------------------------------------------------------

def hf_config(architecture: str, kwargs: dict):
    """A transformers config without end-of-sequence or padding ids: transformers then
    generates every requested token, as pagoda does with ignore_eos."""
    from transformers import LlamaConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[architecture]
    return cls(**kwargs, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def random_model(config, dtype, device, seed: int):
    """A transformers model with random weights, created on the device directly (an 8B model
    on the CPU would take minutes)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def word_tokenizer(vocab_size: int):
    """A tokenizer over the whole vocabulary (id i is the word 't<i>', 0 the unknown word):
    pagoda loads a tokenizer from the model's folder, and random models come with none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def save_folder(run: Run, model, name: str) -> str:
    """The model and a tokenizer as a Hugging Face folder (safetensors), what LLM(model=)
    loads."""
    folder = os.path.join(run.work_dir, name)
    model.save_pretrained(folder)
    word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def random_prompts(vocab_size: int, lengths: list, seed: int) -> list:
    """Token ids drawn from the vocabulary past id 0 (the tokenizer's only special token)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


@contextlib.contextmanager
def pagoda_engine(run: Run, folder: str, **kwargs):
    """pagoda's offline LLM on the folder; its KV cache and weights freed on the way out, so
    that the next engine's memory profile sees the device empty."""
    from pagoda import LLM
    device = device_of(run)
    llm = LLM(model=folder, device=run.plan.device, **run.plan.engine_kwargs, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.executor.worker.free_cache()
        del llm
        free_device_memory(device)


# --- parity ----------------------------------------------------------------------------------

def section_parity(run: Run, device) -> list:
    run.raw["parity"] = {}
    return [guarded_row(run, "parity", f"{arch} {dtype}",
                        lambda arch=arch, dtype=dtype: parity_case(run, device, arch, dtype))
            for arch, dtype in run.plan.parity_cases]


def parity_case(run: Run, device, architecture: str, dtype_name: str) -> Row:
    import torch
    from pagoda import SamplingParams
    p = run.plan
    dtype = getattr(torch, dtype_name)
    extra = dict(tie_word_embeddings=True, rope_theta=1e6) if architecture == "qwen2" else {}
    config = hf_config(architecture, dict(p.parity_config, initializer_range=0.1, **extra))
    prompts = random_prompts(config.vocab_size, p.parity_prompt_lens, seed=11)
    n = p.parity_new_tokens
    model = random_model(config, dtype, device, seed=12)
    expected = [hf_greedy(model, prompt, n, device) for prompt in prompts]
    folder = save_folder(run, model, f"parity-{architecture}-{dtype_name}")
    del model
    free_device_memory(device)
    log(run, f"parity: {architecture} {dtype_name}: transformers done, pagoda next")
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=TOP_K)
    with pagoda_engine(run, folder, dtype=dtype_name, num_gpu_blocks_override=512,
                       max_model_len=config.max_position_embeddings) as llm:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params,
                               use_tqdm=False)
    shutil.rmtree(folder, ignore_errors=True)
    identical, near_ties, mismatches = compare_greedy(outputs, expected)
    run.raw["parity"][f"{architecture} {dtype_name}"] = dict(
        prompt_lens=p.parity_prompt_lens, new_tokens=n, identical=identical,
        near_ties=near_ties, mismatches=mismatches)
    result = (f"{len(prompts)} prompts ({min(p.parity_prompt_lens)}-"
              f"{max(p.parity_prompt_lens)} tokens) x {n} tokens: {identical} identical, "
              f"{len(near_ties)} near-tie(s), {len(mismatches)} mismatch(es)")
    for line in near_ties + mismatches:
        log(run, f"parity: {architecture} {dtype_name}: {line}")
    log(run, f"parity: {architecture} {dtype_name}: {result}")
    if mismatches:
        result += f"; first: {mismatches[0]}"
    return Row("parity", f"greedy vs transformers, {architecture} {dtype_name}", result,
               "identical, or a near-tie at the first difference",
               "MISMATCH" if mismatches else "ok")


def hf_greedy(model, prompt: list, n: int, device) -> tuple[list, list]:
    """transformers' greedy tokens for one prompt (no padding: it would change the arithmetic)
    and its top-k token ids at each step."""
    import torch
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    tops = [step[0].float().topk(TOP_K).indices.tolist() for step in out.logits]
    return tokens, tops


def compare_greedy(outputs, expected) -> tuple[int, list, list]:
    """(identical prompts, near-ties, mismatches): at the first difference, a near-tie is when
    each side's token is in the other's top-k there (vLLM's check_logprobs_close); after it the
    contexts differ, so the rest of that sequence is not compared."""
    identical, near_ties, mismatches = 0, [], []
    for i, (out, (ref_tokens, ref_tops)) in enumerate(zip(outputs, expected)):
        tokens = list(out.outputs[0].token_ids)
        pos = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        if pos is None:
            if len(tokens) == len(ref_tokens):
                identical += 1
            else:
                mismatches.append(f"prompt {i}: {len(tokens)} tokens, transformers "
                                  f"{len(ref_tokens)}")
            continue
        logprobs = out.outputs[0].logprobs[pos]
        top = sorted(logprobs, key=logprobs.get, reverse=True)[:TOP_K]
        line = (f"prompt {i} position {pos}: pagoda {tokens[pos]} (top {top}), transformers "
                f"{ref_tokens[pos]} (top {ref_tops[pos]})")
        near_tie = tokens[pos] in ref_tops[pos] and ref_tokens[pos] in top
        (near_ties if near_tie else mismatches).append(line)
    return identical, near_ties, mismatches


# --- throughput ------------------------------------------------------------------------------

def model_shape(config: dict) -> dict:
    heads = config["num_attention_heads"]
    return dict(hidden=config["hidden_size"], inter=config["intermediate_size"],
                layers=config["num_hidden_layers"], heads=heads,
                kv_heads=config.get("num_key_value_heads", heads),
                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                vocab=config["vocab_size"])


def matmul_params(s: dict) -> int:
    """Weights every token multiplies by: the layers' projections and the LM head."""
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = s["hidden"] * (q + 2 * kv) + q * s["hidden"] + 3 * s["hidden"] * s["inter"]
    return s["layers"] * per_layer + s["hidden"] * s["vocab"]


def kv_bytes_per_token(s: dict, elt: int) -> int:
    return s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * elt


def roofline_seconds(s: dict, num_prompts: int, input_len: int, output_len: int,
                     max_num_seqs: int, bytes_per_s: float, flop_per_s: float,
                     elt: int = 2) -> float:
    """A lower bound on the workload's time at the two measured ceilings:
    - prefill: every prompt token's matmul FLOPs plus causal attention's, at the matmul rate
      (or the K/V it writes at the copy bandwidth, were that longer);
    - decode: waves of max_num_seqs sequences; each step reads every weight once and each
      sequence's K/V, and does 2 FLOPs per weight and 4 * head_dim per attended key and head
      per sequence; the step takes the longer of its bytes at the copy bandwidth and its FLOPs
      at the matmul rate. The first output token comes from the prefill.
    Perfect batching, no host time, no prefill/decode overlap."""
    token_flops = 2 * matmul_params(s)
    pair_flops = 4 * s["layers"] * s["heads"] * s["head_dim"]
    kv_token = kv_bytes_per_token(s, elt)
    weight_bytes = matmul_params(s) * elt
    prefill_flops = num_prompts * (input_len * token_flops
                                   + pair_flops * input_len * (input_len + 1) / 2)
    seconds = max(prefill_flops / flop_per_s, num_prompts * input_len * kv_token / bytes_per_s)
    left = num_prompts
    while left > 0:
        batch = min(left, max_num_seqs)
        left -= batch
        for step in range(1, output_len):
            context = input_len + step
            step_bytes = weight_bytes + batch * context * kv_token
            step_flops = batch * (token_flops + pair_flops * context)
            seconds += max(step_bytes / bytes_per_s, step_flops / flop_per_s)
    return seconds


def section_throughput(run: Run, device, spec: ModelSpec) -> list:
    import torch
    from shared.config import EngineArgs
    args = run.args
    spec = replace(spec, **{k: v for k, v in dict(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        hf_prompts=args.hf_prompts, hf_batch_size=args.hf_batch_size).items() if v is not None})
    raw = run.raw.setdefault("throughput", {})[spec.name] = dict(spec=asdict(spec))
    dtype = torch.bfloat16
    config = hf_config("llama", spec.config)
    prompts = random_prompts(config.vocab_size, [spec.input_len] * spec.num_prompts, seed=21)
    log(run, f"throughput {spec.name}: creating the random model on {device}")
    model = random_model(config, dtype, device, seed=22)
    num_params = sum(t.numel() for t in model.parameters())
    log(run, f"throughput {spec.name}: {num(num_params / 1e6)} M parameters; transformers on "
             f"{spec.hf_prompts} prompts in batches of {spec.hf_batch_size}")
    hf_s, hf_tokens = hf_static_batching(model, prompts[:spec.hf_prompts], spec.output_len,
                                         spec.hf_batch_size, device)
    hf_rate = hf_tokens / hf_s
    log(run, f"throughput {spec.name}: transformers {num(hf_rate)} output tok/s "
             f"({hf_tokens} tokens in {hf_s:.1f} s); saving the folder")
    folder = save_folder(run, model, f"model-{spec.name}")
    del model
    free_device_memory(device)

    max_num_seqs = EngineArgs.max_num_seqs
    log(run, f"throughput {spec.name}: pagoda loading")
    with pagoda_engine(run, folder, dtype="bfloat16", max_model_len=max_model_len(spec),
                       **throughput_cache_kwargs(run)) as llm:
        seconds, tokens, steps = pagoda_offline(run, llm, prompts, spec, config.vocab_size)
    if spec.name == serve_model(run.plan).name:
        run.folders[spec.name] = folder  # the serve section's model
    else:
        shutil.rmtree(folder, ignore_errors=True)  # 16 GB at the 8B shape
    rate = tokens / seconds
    total_rate = (tokens + spec.num_prompts * spec.input_len) / seconds
    log(run, f"throughput {spec.name}: pagoda {num(rate)} output tok/s ({tokens} tokens in "
             f"{seconds:.1f} s, {steps} steps)")
    raw.update(num_params=num_params, hf_seconds=hf_s, hf_output_tokens=hf_tokens,
               hf_output_tok_s=hf_rate, pagoda_seconds=seconds, pagoda_output_tokens=tokens,
               pagoda_output_tok_s=rate, pagoda_steps=steps, max_num_seqs=max_num_seqs)
    rows = [
        Row("throughput", f"{spec.name} pagoda (bf16, random weights)",
            f"{num(rate)} output tok/s, {num(total_rate)} total ({spec.num_prompts} prompts x "
            f"{spec.input_len} in -> {spec.output_len} out, {seconds:.1f} s, {steps} steps)"),
        Row("throughput", f"{spec.name} transformers static batching",
            f"{num(hf_rate)} output tok/s (batches of {spec.hf_batch_size}, "
            f"{spec.hf_prompts} of the prompts)"),
    ]
    ratio = rate / hf_rate
    raw["ratio_to_hf"] = ratio
    rows.append(Row("throughput", f"{spec.name} pagoda / transformers", f"{ratio:.3g}x",
                    f">= {SPEEDUP_TARGET:.0f}x" if spec.has_targets else "",
                    verdict_at(spec.has_targets, ratio >= SPEEDUP_TARGET)))
    rows.append(roofline_row(run, spec, rate, seconds, max_num_seqs, raw))
    return rows


def roofline_row(run: Run, spec: ModelSpec, rate: float, seconds: float, max_num_seqs: int,
                 raw: dict) -> Row:
    if not (run.copy_bytes_per_s and run.matmul_flop_per_s):
        return Row("throughput", f"{spec.name} roofline", "n/a (the env section failed)")
    bound_s = roofline_seconds(model_shape(spec.config), spec.num_prompts, spec.input_len,
                               spec.output_len, max_num_seqs, run.copy_bytes_per_s,
                               run.matmul_flop_per_s)
    bound_rate = spec.num_prompts * spec.output_len / bound_s
    fraction = bound_s / seconds
    raw.update(roofline_seconds=bound_s, roofline_output_tok_s=bound_rate,
               fraction_of_roofline=fraction)
    log(run, f"throughput {spec.name}: roofline {bound_s:.2f} s ({num(bound_rate)} output "
             f"tok/s); pagoda at {fraction:.0%}")
    return Row("throughput", f"{spec.name} roofline (batches of {max_num_seqs})",
               f"{num(bound_rate)} output tok/s bound ({bound_s:.2f} s); pagoda at "
               f"{fraction:.0%}",
               f">= {ROOFLINE_TARGET:.0%}" if spec.has_targets else "",
               verdict_at(spec.has_targets, fraction >= ROOFLINE_TARGET))


def verdict_at(has_target: bool, met: bool) -> str:
    return "" if not has_target else "ok" if met else "below target"


def max_model_len(spec: ModelSpec) -> int:
    return spec.input_len + spec.output_len + 16


def throughput_cache_kwargs(run: Run) -> dict:
    """On CUDA the default budget (a profile run, 0.9 of the memory); the smoke mode's tiny
    model needs only a small cache."""
    return {} if run.plan.device == "cuda" else dict(num_gpu_blocks_override=256)


def pagoda_offline(run: Run, llm, prompts: list, spec: ModelSpec,
                   vocab_size: int) -> tuple[float, int, int]:
    """One warm-up on other prompts, then the workload -> (seconds, output tokens, steps)."""
    from pagoda import SamplingParams
    device = device_of(run)
    warmup = random_prompts(vocab_size, [spec.input_len] * 2, seed=23)
    llm.generate(prompt_token_ids=warmup, use_tqdm=False,
                 sampling_params=SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
    steps_before = llm.llm_engine.get_stats().num_steps
    synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return seconds, tokens, llm.llm_engine.get_stats().num_steps - steps_before


def hf_static_batching(model, prompts: list, output_len: int, batch_size: int,
                       device) -> tuple[float, int]:
    """transformers' generate on static batches (left-padded; the prompts here are of one
    length) -> (seconds, output tokens), after a short warm-up."""
    import torch
    pad = 0

    def generate(batch, new_tokens):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    with torch.inference_mode():
        generate(prompts[:2], 4)
        synchronize(device)
        start = time.perf_counter()
        tokens = sum(generate(prompts[i:i + batch_size], output_len)
                     for i in range(0, len(prompts), batch_size))
        synchronize(device)
    return time.perf_counter() - start, tokens


# --- serve -----------------------------------------------------------------------------------

SERVE_MODULES = ("zmq", "structlog", "fastapi", "uvicorn", "pydantic", "openai")


def section_serve(run: Run, device) -> list:
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        reason = f"missing {', '.join(missing)} (carry the wheels: ops/gpu_wheels.sh)"
        log(run, f"serve: skipped: {reason}")
        return [Row("serve", "pagoda serve + bench serve", f"skipped: {reason}",
                    verdict="skipped")]
    p = run.plan
    spec = serve_model(p)
    folder = run.folders.get(spec.name) or build_folder(run, device, spec)
    port = free_port()
    run_dir = os.path.join(run.work_dir, "serve")
    max_len = p.serve_input_len + p.serve_output_len + 16
    command = [sys.executable, "-m", "pagoda", "serve", "--model", folder,
               "--device", p.device, "--dtype", "bfloat16", "--port", str(port),
               "--run-dir", run_dir, "--max-model-len", str(max_len), "--keep-logs",
               "--startup-timeout", "240"]
    log_path = os.path.join(run.work_dir, "serve.log")
    log(run, f"serve: {' '.join(command)}")
    server = start_process(run, command, log_path)
    try:
        ready_s = wait_ready(run, server, log_path, timeout_s=270)
        log(run, f"serve: ready after {ready_s:.0f} s; pagoda bench serve next")
        summary = bench_serve(run, f"http://127.0.0.1:{port}", folder)
    except Exception:
        keep_serve_logs(run, log_path, run_dir)
        raise
    finally:
        stop_process(run, server)
    run.raw["serve"] = dict(ready_s=ready_s, summary=summary)
    ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
    result = (f"{num(summary['output_throughput'])} output tok/s; TTFT p50 "
              f"{fmt_ms(ttft['p50'])} / p99 {fmt_ms(ttft['p99'])} ms; TPOT p50 "
              f"{fmt_ms(tpot['p50'])} / p99 {fmt_ms(tpot['p99'])} ms "
              f"({summary['completed']}/{p.serve_prompts} completed, {p.serve_input_len} in -> "
              f"{p.serve_output_len} out, all at once; stack ready in {ready_s:.0f} s)")
    log(run, f"serve: {result}")
    failed = summary["failed"] > 0
    return [Row("serve", f"{spec.name} pagoda serve --device {p.device}", result,
                "every request completed", "FAILED" if failed else "ok")]


def serve_model(plan: Plan) -> ModelSpec:
    return next((m for m in plan.models if m.name == "1B"), plan.models[0])


def fmt_ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def build_folder(run: Run, device, spec: ModelSpec) -> str:
    import torch
    log(run, f"serve: creating the random {spec.name} model")
    model = random_model(hf_config("llama", spec.config), torch.bfloat16, device, seed=22)
    folder = save_folder(run, model, f"model-{spec.name}")
    del model
    free_device_memory(device)
    run.folders[spec.name] = folder
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(run: Run, command: list, log_path: str) -> subprocess.Popen:
    """A child in its own process group, its output in log_path, stopped at any exit."""
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    run.children.append(proc)
    return proc


def stop_process(run: Run, proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (pagoda serve stops its stack in order), then SIGKILL to the group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc in run.children:
        run.children.remove(proc)


def wait_ready(run: Run, proc: subprocess.Popen, log_path: str, timeout_s: float) -> float:
    """Seconds until `pagoda serve` prints its ready banner; an error if it exits first."""
    start = time.monotonic()
    last_note = start
    while time.monotonic() - start < timeout_s:
        with open(log_path, errors="replace") as f:
            text = f.read()
        if "pagoda: ready" in text:
            return time.monotonic() - start
        if proc.poll() is not None:
            raise RuntimeError(f"pagoda serve exited ({proc.returncode}) before it was ready: "
                               f"{tail(text, 6)}")
        if time.monotonic() - last_note > 30:
            log(run, f"serve: still starting ({time.monotonic() - start:.0f} s)")
            last_note = time.monotonic()
        time.sleep(1.0)
    raise TimeoutError(f"pagoda serve not ready after {timeout_s:.0f} s")


def tail(text: str, lines: int) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def bench_serve(run: Run, base_url: str, tokenizer: str) -> dict:
    """`pagoda bench serve` as a user runs it -> its summary at rate inf."""
    p = run.plan
    out_json = os.path.join(run.work_dir, "bench_serve.json")
    command = [sys.executable, "-m", "pagoda", "bench", "serve", "--base-url", base_url,
               "--num-prompts", str(p.serve_prompts), "--input-len", str(p.serve_input_len),
               "--output-len", str(p.serve_output_len), "--request-rate", "inf",
               "--tokenizer", tokenizer, "--timeout", "150", "--output-json", out_json]
    log(run, f"serve: {' '.join(command[3:])}")
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    for line in done.stdout.strip().splitlines():
        log(run, f"serve: | {line}")
    if done.returncode != 0:
        raise RuntimeError(f"pagoda bench serve exited {done.returncode}: "
                           f"{tail(done.stderr or done.stdout, 6)}")
    with open(out_json) as f:
        return json.load(f)["summaries"][0]


def keep_serve_logs(run: Run, log_path: str, run_dir: str) -> None:
    """A failed serve's logs, beside the results (pagoda serve's own and the worker's)."""
    for path in (log_path, os.path.join(run_dir, "logs", "worker-0.log")):
        if os.path.isfile(path):
            with contextlib.suppress(OSError):
                shutil.copy(path, os.path.join(run.results_dir,
                                               "gpu_check_" + os.path.basename(path)))


# --- the run ---------------------------------------------------------------------------------

def sections(run: Run) -> list:
    """(name, skipped because, function) in the order they run."""
    a, p = run.args, run.plan
    items = [("env", None, section_env),
             ("kernels", "--skip-kernels" if a.skip_kernels else None, section_kernels),
             ("parity", "--skip-parity" if a.skip_parity else None, section_parity)]
    for spec in p.models:
        why = ("--skip-throughput" if a.skip_throughput else
               "not in --models" if a.models and spec.name.lower() not in a.models else None)
        items.append((f"throughput {spec.name}", why,
                      lambda run, device, spec=spec: section_throughput(run, device, spec)))
    serve_why = ("--skip-serve" if a.skip_serve else
                 "--device cpu (smoke mode)" if not p.serve else None)
    items.append(("serve", serve_why, section_serve))
    return items


def run_section(run: Run, name: str, fn, device) -> None:
    left = run.args.deadline_s - (time.monotonic() - run.started)
    needed = run.plan.min_left_s.get(name, 0)
    if left < needed:
        reason = f"{left:.0f} s left before the deadline, {needed} s needed"
        log(run, f"{name}: skipped: {reason}")
        run.rows.append(Row(name.split()[0], name, f"skipped: {reason}", verdict="skipped"))
        return
    log(run, f"== {name}")
    run.section = name
    try:
        rows = fn(run, device)
    except Exception as e:  # the table reports it; the next section still runs
        log(run, f"{name} FAILED: {type(e).__name__}: {e}")
        rows = [Row(name.split()[0], name, f"FAILED: {type(e).__name__}: {e}",
                    verdict="FAILED")]
    finally:
        run.section = None
        free_device_memory(device)
    with run.lock:
        run.rows.extend(rows)
        write_results(run)


def table_lines(rows: list) -> list:
    header = ("section", "check", "result", "target", "verdict")
    cells = [header] + [(r.section, r.check, r.result, r.target, r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]

    def line(values):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"
    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [
        line(c) for c in cells[1:]]


def write_results(run: Run) -> None:
    os.makedirs(run.results_dir, exist_ok=True)
    payload = dict(meta=dict(run.meta, device=run.plan.device, quick=run.args.quick,
                             elapsed_s=time.monotonic() - run.started,
                             finished=run.finished),
                   rows=[asdict(r) for r in run.rows], raw=run.raw)
    with open(os.path.join(run.results_dir, "gpu_check.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)
    title = (f"# GPU check, {time.strftime('%Y-%m-%d %H:%M')}: {run.meta.get('gpu', '?')}; "
             f"{run.meta.get('versions', '')}")
    with open(os.path.join(run.results_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join([title, ""] + table_lines(run.rows)) + "\n")


def finish(run: Run, note: str | None = None) -> int:
    """The table, printed and written; children stopped; the work folder removed. -> exit
    status: 1 when a row failed or mismatched."""
    with run.lock:
        if run.finished:
            return 0
        if note:
            name = run.section or "run"
            run.rows.append(Row(name.split()[0], name, f"FAILED: {note}", verdict="FAILED"))
            run.rows += [Row(later.split()[0], later, "skipped: the deadline came first",
                             verdict="skipped") for later in run.pending]
        run.finished = True
        for proc in list(run.children):
            with contextlib.suppress(Exception):
                stop_process(run, proc, grace_s=5.0)
        write_results(run)
        print("\n" + "\n".join(table_lines(run.rows)), flush=True)
        print(f"\n(written to {run.results_dir}/gpu_check.json and gpu_check.md; "
              f"{time.monotonic() - run.started:.0f} s)", flush=True)
        shutil.rmtree(run.work_dir, ignore_errors=True)
    return 1 if any(r.verdict in ("FAILED", "MISMATCH") for r in run.rows) else 0


def start_watchdog(run: Run) -> None:
    """At the deadline: the table as it stands, then exit, whatever the main thread does."""
    def expire():
        log(run, f"deadline of {run.args.deadline_s:.0f} s reached")
        finish(run, f"deadline of {run.args.deadline_s:.0f} s reached during this section")
        os._exit(2)
    timer = threading.Timer(max(0.0, run.args.deadline_s - (time.monotonic() - run.started)),
                            expire)
    timer.daemon = True
    timer.start()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.bench.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda when there is one; cpu is the smoke mode")
    parser.add_argument("--quick", action="store_true",
                        help="fewer kernel shapes, parity cases and smaller workloads")
    for name in ("kernels", "parity", "throughput", "serve"):
        parser.add_argument(f"--skip-{name}", action="store_true")
    parser.add_argument("--models", nargs="+", type=str.lower, default=None,
                        help="throughput models to run (1b, 8b; default all)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--hf-prompts", type=int, default=None,
                        help="prompts transformers runs (its rate does not depend on it)")
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--deadline-s", type=float, default=450.0,
                        help="print the table and exit after this long (default %(default)s)")
    parser.add_argument("--results-dir", default=None,
                        help="default: $OUT if set, else ops/results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        # triton.jit reads this when the kernel modules are imported, later on.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    plan = cuda_plan(args.quick) if args.device == "cuda" else cpu_plan()
    results_dir = args.results_dir or os.environ.get("OUT") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    run = Run(plan=plan, args=args, results_dir=results_dir,
              work_dir=tempfile.mkdtemp(prefix="gpu_check-"))
    start_watchdog(run)
    log(run, f"GPU check on {args.device}{' (quick)' if args.quick else ''}; deadline "
             f"{args.deadline_s:.0f} s; results to {results_dir}")
    device = torch.device(args.device)
    planned = sections(run)
    run.pending = [name for name, skipped_because, _ in planned if not skipped_because]
    for name, skipped_because, fn in planned:
        if name in run.pending:
            run.pending.remove(name)
        if skipped_because:
            log(run, f"{name}: skipped: {skipped_because}")
            run.rows.append(Row(name.split()[0], name, f"skipped: {skipped_because}",
                                verdict="skipped"))
            continue
        run_section(run, name, fn, device)
    return finish(run)


if __name__ == "__main__":
    sys.exit(main())
