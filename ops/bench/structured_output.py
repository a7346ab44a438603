"""Offline greedy throughput with and without a JSON schema, on the same prompts, alternating.

    .venv/bin/python -m ops.bench.structured_output --num-prompts 32 --output-len 64 --rounds 3

The schema asks for an array of at least 10 small objects, so every request stays under its
grammar for all `--output-len` tokens; the free runs ignore EOS so both produce the same count.
It also times the worker's grammar work alone (bitmask fill, masking, matcher advance) per step
for a batch of constrained rows.
"""
import argparse
import statistics
import time

import torch

from pagoda import LLM, SamplingParams
from shared.structured_output import StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 10, "items": {
    "type": "object", "required": ["name", "age"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}}}}


def time_grammar_step(model_config, num_rows: int, num_steps: int = 48) -> float:
    """Mean seconds of GrammarMasker.mask + advance per step over `num_rows` constrained rows
    (random logits, the best allowed token taken)."""
    from services.worker.grammar import GrammarMasker, new_matcher
    from services.worker.grammar_compiler import GrammarCompilerPool
    compiler = GrammarCompilerPool(model_config)
    grammar = compiler.submit(StructuredOutputsParams(json=SCHEMA))
    vocab = model_config.vocab_size
    masker = GrammarMasker(vocab, torch.device("cpu"))
    matchers = [new_matcher(grammar, [0]) for _ in range(num_rows)]
    rows = list(range(num_rows))
    gen = torch.Generator().manual_seed(0)
    elapsed = 0.0
    for _ in range(num_steps):
        logits = torch.randn(num_rows, vocab, generator=gen)
        t0 = time.perf_counter()
        masker.mask(logits, rows, matchers, [[0]] * num_rows)
        t1 = time.perf_counter()
        tokens = logits.argmax(dim=-1).tolist()  # the sampler's part: not counted
        t2 = time.perf_counter()
        masker.advance(matchers, tokens)
        elapsed += (t1 - t0) + (time.perf_counter() - t2)
    compiler.shutdown()
    return elapsed / num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-space-gib", type=float, default=1.0)
    args = parser.parse_args()

    llm = LLM(args.model, kv_cache_space_gib=args.kv_cache_space_gib)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"List ten people (#{i}) as JSON: name and age."}],
        tokenize=False, add_generation_prompt=True) for i in range(args.num_prompts)]
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    runs = {"free": free, "json_schema": constrained}
    llm.generate(prompts[:2], constrained, use_tqdm=False)  # warm up, grammar compiled
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, params in runs.items():
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if name == "json_schema":
                assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
            rates[name].append(tokens / elapsed)
            print(f"{name:12s} {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tok/s",
                  flush=True)
    for num_rows in (1, args.num_prompts):
        per_step = time_grammar_step(llm.llm_engine.model_config, num_rows)
        print(f"grammar work per step, {num_rows} constrained rows: {per_step * 1e3:.2f} ms")
    ratios = [c / f for f, c in zip(rates["free"], rates["json_schema"])]
    print(f"median free {statistics.median(rates['free']):.1f} tok/s, json_schema "
          f"{statistics.median(rates['json_schema']):.1f} tok/s, ratio per round "
          f"{', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
