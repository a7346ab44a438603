"""The parity section: greedy tokens of the whole engine (`pagoda.LLM`) against transformers on
small random Llama and Qwen2 models, fp32 and bf16; a divergence passes only at a near-tie
(each side's token in the other's top 5 there)."""
import shutil

from .measure import free_device_memory, guarded_row
from .plan import TOP_K
from .random_models import hf_config, pagoda_engine, random_model, random_prompts, save_folder
from .report import Row, Run, log


def section_parity(run: Run, device) -> list:
    from .int8_checks import MODES, int8_engine_case
    run.raw["parity"] = {}
    rows = [guarded_row(run, "parity", f"{arch} {dtype}",
                        lambda arch=arch, dtype=dtype: parity_case(run, device, arch, dtype))
            for arch, dtype in run.plan.parity_cases]
    if run.plan.int8_engine:  # CUDA: on the CPU the int8 engine is tests/test_int8_weights.py's
        rows += [guarded_row(run, "parity", f"--quantization {mode}",
                             lambda mode=mode: int8_engine_case(run, device, mode))
                 for mode in MODES]
    return rows


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
