"""`--quantization int8` / `w8a8` on the device: the Triton kernels of
pagoda_kernels/triton/int8_matmul.py against the float64 product of the dequantized weight (and, for
w8a8, of the activations as quantize_rows quantizes them), their time at the 8B shapes against
bf16 F.linear, and (CUDA only) the whole engine's greedy tokens with each against the
unquantized engine on the parity section's random Llama."""
import shutil

from .measure import device_generator, free_device_memory, median_seconds
from .plan import TOP_K
from .random_models import hf_config, pagoda_engine, random_model, random_prompts, save_folder
from .report import Row, Run, fraction_of_copy, log, num

MODES = ("int8", "w8a8")


def _weights(n: int, k: int, device, seed: int):
    import torch
    from services.worker.models.int8 import quantize_rows
    g = device_generator(device, seed)
    return quantize_rows(torch.randn(n, k, generator=g, device=device) * 0.05)


def check_int8_matmuls(run: Run, device, dtype) -> Row:
    """Every (M, N, K) of the plan, both kernels, with a bias: the largest error beyond half an
    ulp of dtype plus float32 rounding of the K-term sum (tests/test_triton_int8.py's bound),
    NaN-poisoned outputs; the row quantization bit-equal to quantize_rows."""
    import torch
    from pagoda_kernels.triton import int8_matmul
    from services.worker.models.int8 import quantize_rows
    half_ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    worst, failures = 0.0, []
    for i, (m, n, k) in enumerate(run.plan.int8_check_shapes):
        g = device_generator(device, 100 + i)
        x = torch.randn(m, k, generator=g, device=device).to(dtype)
        bias = torch.randn(n, generator=g, device=device).to(dtype)
        q, s = _weights(n, k, device, 200 + i)
        for mode in MODES:
            if mode == "w8a8":
                xq, xs = quantize_rows(x)
                got_q, got_s = int8_matmul.quantize_rows_int8(x)
                if not (torch.equal(got_q, xq) and torch.equal(got_s, xs)):
                    failures.append(f"{mode} {m}x{n}x{k}: row quantization differs")
                terms = (xq.double() @ q.double().T) * xs.double()[:, None] * s.double()
                ref, abs_terms, sum_k = terms + bias.double(), terms.abs(), 0
                fn = int8_matmul.w8a8_linear
            else:
                w = q.double() * s.double()[:, None]
                ref = x.double() @ w.T + bias.double()
                abs_terms, sum_k = x.double().abs() @ w.abs().T, k
                fn = int8_matmul.int8_linear
            out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
            fn(x, q, s, bias, out=out)
            bound = half_ulp * ref.abs() + (2 * sum_k + 4) * 2.0 ** -24 * (abs_terms +
                                                                            bias.double().abs())
            excess = ((out.double() - ref).abs() - bound).max().item()
            worst = max(worst, excess if excess == excess else float("inf"))
            if not excess <= 0:
                failures.append(f"{mode} {m}x{n}x{k}: {excess:.2e} beyond the bound")
    shapes = ", ".join(f"{m}x{n}x{k}" for m, n, k in run.plan.int8_check_shapes)
    result = (f"{'; '.join(failures) if failures else 'within the bound'} "
              f"(M x N x K {shapes}, {str(dtype).removeprefix('torch.')}, bias)")
    log(run, f"kernels: int8 / w8a8 matmul check: {result}")
    return Row("kernels", "int8_linear / w8a8_linear: correctness", result,
               "half an ulp + fp32 sum rounding of the float64 reference",
               "MISMATCH" if failures else "ok")


def time_int8_matmuls(run: Run, device, dtype, raw: dict) -> list:
    """Each (M, N, K) of the plan: bf16 F.linear, then int8 and w8a8; GB/s of the weight read
    (what bounds decode) and the fraction of the copy bandwidth, TFLOP/s."""
    import torch
    import torch.nn.functional as F
    from pagoda_kernels.triton import int8_matmul
    p = run.plan
    rows, raw["int8"] = [], []
    for m, n, k in p.int8_timings:
        g = device_generator(device, 7)
        x = torch.randn(m, k, generator=g, device=device).to(dtype)
        dense = torch.randn(n, k, generator=g, device=device).to(dtype)
        q, s = _weights(n, k, device, 8)
        out = torch.empty(m, n, dtype=dtype, device=device)
        cases = (("bf16 F.linear", lambda: F.linear(x, dense), dense.element_size()),
                 ("int8", lambda: int8_matmul.int8_linear(x, q, s, out=out), 1),
                 ("w8a8", lambda: int8_matmul.w8a8_linear(x, q, s, out=out), 1))
        for name, fn, weight_bytes in cases:
            seconds = median_seconds(fn, device, p.timing_iters, p.warmup)
            rate = n * k * weight_bytes / seconds
            flops = 2 * m * n * k / seconds
            raw["int8"].append(dict(m=m, n=n, k=k, kernel=name, seconds=seconds,
                                    weight_bytes_per_s=rate, flop_per_s=flops))
            result = (f"{seconds * 1e6:.1f} us, weight {num(rate / 1e9)} GB/s "
                      f"({fraction_of_copy(run, rate)}), {num(flops / 1e12)} TFLOP/s")
            log(run, f"kernels: {name} {m}x{n}x{k}: {result}")
            rows.append(Row("kernels", f"{name}, M {m}, N {n}, K {k}", result))
        free_device_memory(device)
    return rows


def int8_engine_case(run: Run, device, mode: str) -> Row:
    """The parity section's random Llama (bf16) under `--quantization mode` against the same
    model unquantized, both pagoda: greedy tokens identical or a near-tie (each side's token in
    the other's top 5) at the first difference. The weights are rounded to 8 bits, so a
    divergence is expected sooner or later; this says the CUDA path runs end to end and stays
    close, not that it is exact."""
    import torch
    from pagoda import SamplingParams

    from .parity import compare_greedy
    p = run.plan
    config = hf_config("llama", dict(p.parity_config, initializer_range=0.1))
    prompts = random_prompts(config.vocab_size, p.parity_prompt_lens, seed=21)
    model = random_model(config, torch.bfloat16, device, seed=22)
    folder = save_folder(run, model, f"int8-{mode}")
    del model
    free_device_memory(device)
    params = SamplingParams(temperature=0.0, max_tokens=p.parity_new_tokens, ignore_eos=True,
                            logprobs=TOP_K)
    results = {}
    for quantization in (None, mode):
        with pagoda_engine(run, folder, dtype="bfloat16", num_gpu_blocks_override=512,
                           max_model_len=config.max_position_embeddings,
                           quantization=quantization) as llm:
            results[quantization] = llm.generate(prompt_token_ids=prompts,
                                                 sampling_params=params, use_tqdm=False)
    shutil.rmtree(folder, ignore_errors=True)
    expected = []
    for out in results[None]:
        o = out.outputs[0]
        tops = [sorted(lp, key=lp.get, reverse=True)[:TOP_K] for lp in o.logprobs]
        expected.append((list(o.token_ids), tops))
    identical, near_ties, mismatches = compare_greedy(results[mode], expected)
    result = (f"{len(prompts)} prompts x {p.parity_new_tokens} tokens: {identical} identical, "
              f"{len(near_ties)} near-tie(s), {len(mismatches)} mismatch(es)")
    for line in near_ties + mismatches:
        log(run, f"parity: {mode}: {line}")
    log(run, f"parity: {mode} vs unquantized: {result}")
    return Row("parity", f"greedy, --quantization {mode} vs unquantized, llama bfloat16", result,
               "identical, or a near-tie at the first difference",
               "MISMATCH" if mismatches else "ok")
