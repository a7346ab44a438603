"""Speculative decoding against plain decoding: single-stream decode on text that repeats its
context.

`pagoda bench spec --rounds 3 [--speculative-config JSON] [engine flags]` loads the model twice
in this process with the same engine flags (`pagoda serve`'s; --kv-cache-space-gib defaults to
0.5 here), once plain and once with the speculative config (default: n-gram, k = 4,
lookup 4..2), and sends each prompt alone (one request at a time, greedy, `--output-len`
tokens) to each, in alternating order each round. The prompts ask for a rewrite of a given
piece of code with one change, or a summary that quotes a given text: output that n-gram
lookup finds in the prompt. It reports each engine's output tok/s per round, the medians, the
ratio by round and of the medians, and the acceptance rate and mean accepted length. Both
engines produce the same greedy tokens, which it checks.
"""
import argparse
import dataclasses
import json
import statistics
import time

_CODE = '''def load_records(path):
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, value = line.split("=", 1)
            records.append((name.strip(), int(value)))
    return records


def total(records):
    return sum(value for _, value in records)
'''

_TEXT = ("The river town grew up around a wooden bridge that merchants crossed twice a week. "
         "When the bridge burned in the winter of 1821, the town council voted to build a stone "
         "bridge in its place, paid for by a toll on every cart. The toll was lifted in 1850, "
         "once the bridge had paid for itself, and the market moved to the square beside it, "
         "where it is still held every Saturday morning.")

PROMPTS = [
    f"Rewrite this code with one change: rename the function load_records to read_records. "
    f"Reply with the whole code only.\n\n```python\n{_CODE}```",
    f"Rewrite this code with one change: make total return 0.0 for an empty list. Reply with "
    f"the whole code only.\n\n```python\n{_CODE}```",
    f"Summarise this text in three sentences, quoting its own words where you can:\n\n{_TEXT}",
    f"Repeat this text exactly, then give it a title:\n\n{_TEXT}",
]

_DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                 "prompt_lookup_min": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shared.engine_args import EngineArgs
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                        help=f"how many of the {len(PROMPTS)} prompts (cycled beyond that)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(speculative_config=json.dumps(_DEFAULT_SPEC), kv_cache_space_gib=0.5)


def engine_args(args: argparse.Namespace) -> dict:
    """The two engines' EngineArgs: "plain" (speculation off) and "speculative"."""
    from shared.engine_args import EngineArgs
    speculative = EngineArgs.from_cli_args(args)
    if not speculative.speculative_config:
        raise SystemExit("--speculative-config: give the configuration to compare")
    return {"plain": dataclasses.replace(speculative, speculative_config=None),
            "speculative": speculative}


def _decode_alone(llm, conversations, params) -> tuple[float, list[list[int]]]:
    """Each conversation as the only request in the engine -> (seconds in all, token ids)."""
    tokens, seconds = [], 0.0
    for conv in conversations:
        start = time.perf_counter()
        out = llm.chat(conv, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens.append(list(out[0].outputs[0].token_ids))
    return seconds, tokens


def run(args: argparse.Namespace) -> int:
    from pagoda import LLM
    if args.rounds < 1 or args.num_prompts < 1 or args.output_len < 1:
        raise SystemExit("--rounds, --num-prompts and --output-len must be at least 1")
    engines = {name: LLM(**a.to_dict()) for name, a in engine_args(args).items()}
    try:
        result = measure(engines, args)
    finally:
        for llm in engines.values():
            llm.close()
    return 0 if result["same_tokens"] else 1


def measure(engines: dict, args: argparse.Namespace) -> dict:
    """The rounds on loaded engines ({"plain": LLM, "speculative": LLM}) -> the result (also
    printed, and written to --output-json)."""
    from pagoda import SamplingParams
    conversations = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
                     for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    # One warm-up request each: kernels compiled and caches touched before anything is timed.
    for llm in engines.values():
        llm.chat(conversations[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    stats = engines["speculative"].llm_engine.get_stats().spec_decode
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    names = list(engines)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]  # who goes first alternates
        for name in order:
            seconds, tokens = _decode_alone(engines[name], conversations, params)
            rate = sum(len(t) for t in tokens) / seconds
            runs[name].append(rate)
            outputs[name] = tokens
            print(f"round {r + 1} {name:>11}: {rate:8.1f} output tok/s "
                  f"({sum(len(t) for t in tokens)} tokens, {seconds:.2f} s)", flush=True)
    stats = engines["speculative"].llm_engine.get_stats().spec_decode
    spec = engines["speculative"].llm_engine.config.speculative_config
    drafts = stats.num_drafts - before[0]
    proposed = stats.num_draft_tokens - before[1]
    accepted = stats.num_accepted_tokens - before[2]
    ratios = [s / p for s, p in zip(runs["speculative"], runs["plain"])]
    medians = {name: statistics.median(v) for name, v in runs.items()}
    result = {
        "speculative_config": {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                               if f.name != "draft_model_config"},
        "output_len": args.output_len, "num_prompts": args.num_prompts, "rounds": args.rounds,
        "output_tok_s": runs, "median_output_tok_s": medians,
        "ratio_by_round": ratios, "ratio_of_medians": medians["speculative"] / medians["plain"],
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
        "same_tokens": outputs["plain"] == outputs["speculative"],
    }
    print(f"median: plain {medians['plain']:.1f}, speculative {medians['speculative']:.1f} "
          f"output tok/s; ratio {result['ratio_of_medians']:.2f} "
          f"(by round {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"acceptance rate {result['acceptance_rate']:.3f}, mean accepted length "
          f"{result['mean_accepted_length']:.2f} tokens per speculating step; same greedy "
          f"tokens: {result['same_tokens']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
