"""The throughput sections: offline throughput with random weights at the Llama-3.2-1B and
Llama-3.1-8B shapes (bf16, ignore_eos) against transformers' static batching in the same run
and against the roofline (roofline.py)."""
import shutil
import time
from dataclasses import asdict, replace

from .measure import device_of, free_device_memory, synchronize
from .plan import ROOFLINE_TARGET, SPEEDUP_TARGET, ModelSpec, serve_model
from .random_models import hf_config, pagoda_engine, random_model, random_prompts, save_folder
from .report import Row, Run, log, num
from .roofline import model_shape, roofline_seconds


def section_throughput(run: Run, device, spec: ModelSpec) -> list:
    import torch
    from shared.engine_args import EngineArgs
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
