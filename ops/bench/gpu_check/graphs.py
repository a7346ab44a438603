"""The graphs section: small-batch decode step time with the CUDA graphs pagoda captures for
decode steps against eager steps, on the 1B random model (the folder the throughput section
saved, or one made here), and the greedy tokens of the two modes compared. Both run with async
scheduling (the worker launches step N+1 behind N); a third mode, graphs without it
(`--no-async-scheduling`: every step waits for the one before to come back), measures what
that overlap is worth at small batches, where the host's share of a step is largest.

One engine serves both modes: eager is the same engine with its graphs set aside
(`ModelRunner.decode_graphs = None`, what `--enforce-eager` leaves), which saves a second
load and capture. A decode step's time is isolated from the prefill: each batch is generated
twice, to one token (the prefill step alone) and to 1 + N tokens, and the difference is divided
by N."""
import time

from .measure import device_of, synchronize
from .parity import compare_greedy
from .plan import GRAPHS_TARGET, TOP_K, serve_model
from .random_models import hf_config, pagoda_engine, random_model, random_prompts, save_folder
from .report import Row, Run, log


def section_graphs(run: Run, device) -> list:
    import torch
    p = run.plan
    spec = serve_model(p)
    config = hf_config("llama", spec.config)
    folder = run.folders.get(spec.name)
    if folder is None:  # the throughput section did not run
        log(run, f"graphs: creating the {spec.name} random model")
        model = random_model(config, torch.bfloat16, device, seed=22)
        folder = run.folders[spec.name] = save_folder(run, model, f"model-{spec.name}")
        del model
    prompts = {b: random_prompts(config.vocab_size, [p.graphs_input_len] * b, seed=31 + b)
               for b in p.graphs_batches}
    raw = run.raw["graphs"] = dict(batches=p.graphs_batches, decode_steps=p.graphs_decode_steps,
                                   input_len=p.graphs_input_len)
    step_s, outputs = {}, {}
    on_cuda = device.type == "cuda"  # the smoke mode has no graphs: both modes run eagerly
    log(run, "graphs: pagoda loading")
    start = time.perf_counter()
    with pagoda_engine(run, folder, dtype="bfloat16", max_num_seqs=max(p.graphs_batches),
                       max_model_len=p.graphs_input_len + p.graphs_decode_steps + 16,
                       **cache_kwargs(run)) as llm:
        runner = llm.llm_engine.executor.worker.model_runner
        graphs = runner.decode_graphs
        log(run, f"graphs: engine ready in {time.perf_counter() - start:.1f} s, graphs at "
                 f"{sorted(graphs.graphs) if graphs is not None else 'none'}")
        if on_cuda and graphs is None:
            raise RuntimeError("the worker captured no decode graphs")
        scheduler_config = llm.llm_engine.config.scheduler_config
        for mode in ("graphs", "eager", "synchronous"):
            runner.decode_graphs = None if mode == "eager" else graphs
            scheduler_config.async_scheduling = mode != "synchronous"
            for b in p.graphs_batches:
                step_s[mode, b], outputs[mode, b] = decode_step_seconds(run, llm, prompts[b])
                log(run, f"graphs: {mode} batch {b}: {step_s[mode, b] * 1e3:.2f} ms a step")
        runner.decode_graphs = graphs
    raw["step_ms"] = {f"{mode} {b}": s * 1e3 for (mode, b), s in step_s.items()}
    rows = []
    for b in p.graphs_batches:
        eager_s, graph_s = step_s["eager", b], step_s["graphs", b]
        ratio = eager_s / graph_s
        raw[f"speedup {b}"] = ratio
        rows.append(Row("graphs", f"decode step at batch {b}, graphs vs eager",
                        f"{graph_s * 1e3:.2f} ms vs {eager_s * 1e3:.2f} ms: {ratio:.2f}x",
                        f">= {GRAPHS_TARGET}x" if on_cuda else "",
                        ("ok" if ratio >= GRAPHS_TARGET else "below target") if on_cuda
                        else ""))
    for b in p.graphs_batches:
        sync_s, async_s = step_s["synchronous", b], step_s["graphs", b]
        raw[f"async speedup {b}"] = sync_s / async_s
        rows.append(Row("graphs", f"decode step at batch {b}, async scheduling vs synchronous",
                        f"{async_s * 1e3:.2f} ms vs {sync_s * 1e3:.2f} ms: "
                        f"{sync_s / async_s:.2f}x", "", ""))
    rows.append(compare_modes(run, outputs, "graphs", "eager"))
    rows.append(compare_modes(run, outputs, "synchronous", "graphs"))
    return rows


def cache_kwargs(run: Run) -> dict:
    return {} if run.plan.device == "cuda" else dict(num_gpu_blocks_override=64)


def decode_step_seconds(run: Run, llm, prompts: list) -> tuple[float, list]:
    """-> (seconds of one decode step of len(prompts) sequences, the longer run's outputs)."""
    from pagoda import SamplingParams
    device = device_of(run)
    steps = run.plan.graphs_decode_steps

    def timed(max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=TOP_K)
        synchronize(device)
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        synchronize(device)
        return time.perf_counter() - start, outs
    timed(2)  # warm-up: the first steps of a batch size pay for one-time work
    prefill_s, _ = timed(1)
    total_s, outs = timed(1 + steps)
    return max(total_s - prefill_s, 0.0) / steps, outs


def compare_modes(run: Run, outputs: dict, mode: str, against: str) -> Row:
    """One mode's greedy tokens against another's: identical, or a near-tie where they part
    (the graph's decode attention is split at the longest context, eager's at the step's, so
    bf16 rounding may differ)."""
    identical = total = 0
    near_ties, mismatches = [], []
    for b in run.plan.graphs_batches:
        reference = [(list(o.outputs[0].token_ids),
                      [sorted(lp, key=lp.get, reverse=True)[:TOP_K]
                       for lp in o.outputs[0].logprobs])
                     for o in outputs[against, b]]
        same, ties, bad = compare_greedy(outputs[mode, b], reference)
        identical += same
        total += len(reference)
        near_ties += [f"batch {b} {line}" for line in ties]
        mismatches += [f"batch {b} {line}" for line in bad]
    for line in near_ties + mismatches:
        log(run, f"graphs: {line}")
    result = (f"{total} sequences: {identical} identical, {len(near_ties)} near-tie(s), "
              f"{len(mismatches)} mismatch(es)")
    if mismatches:
        result += f"; first: {mismatches[0]}"
    log(run, f"graphs: greedy tokens, {mode} vs {against}: {result}")
    return Row("graphs", f"greedy tokens, {mode} vs {against}", result,
               "identical, or a near-tie at the first difference",
               "MISMATCH" if mismatches else "ok")
