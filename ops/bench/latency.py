"""Single-stream decode: one request at a time, pagoda's configurations beside vLLM and llama.cpp.

`pagoda bench latency --rounds 3 --variant bf16= --variant "int8=--quantization int8"
--baseline vllm llama.cpp --vllm-python V/bin/python --llama-cpp-python L/bin/python
--gguf model.Q8_0.gguf [engine flags]` loads every system once and keeps it loaded: each pagoda
variant (the engine flags, then the variant's own flags on top) in this process, vLLM's offline
`LLM` on the engine flags' model and dtype, llama.cpp on each `--gguf` file (peers run in their
own venvs and are stopped between their runs, ops/bench/peers.py). Each round draws one random
prompt of `--input-len` tokens, and every system decodes it alone for `--output-len` greedy tokens
(end-of-text ignored), round after round with the next system first. The first round is reported
apart (the first request after start); the others give each system's median output tok/s
(output tokens over the whole request, prefill included) and, against `--reference` (vLLM when it
runs), each round's ratio and their median.
"""
import argparse
import json
import statistics

from ops.bench.workloads import make_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shared.engine_args import EngineArgs
    parser.add_argument("--rounds", type=int, default=3, help="warm rounds, after the first")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--variant", action="append", default=None, metavar="NAME=FLAGS",
                        help="a pagoda configuration: the engine flags plus FLAGS (e.g. "
                             "'int8=--quantization int8'); repeat for several (default: one, "
                             "'pagoda', the engine flags alone)")
    parser.add_argument("--baseline", nargs="+", choices=["none", "vllm", "llama.cpp"],
                        default=["none"])
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--llama-cpp-python", default=None)
    parser.add_argument("--gguf", nargs="+", default=[],
                        help="GGUF files llama.cpp runs (one system each)")
    parser.add_argument("--reference", default=None,
                        help="the system the ratios are against (default: vllm if it runs)")
    parser.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(parser)


def variant_args(base, name_flags: str):
    """'NAME=FLAGS' -> (NAME, EngineArgs: `base` with FLAGS on top)."""
    import shlex

    from shared.engine_args import EngineArgs
    name, _, flags = name_flags.partition("=")
    if not name:
        raise SystemExit(f"--variant {name_flags!r}: give it a name, NAME=FLAGS")
    parser = argparse.ArgumentParser(prog=f"--variant {name}")
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:  # only the flags given override the base
        action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(shlex.split(flags)))
    return name, EngineArgs(**{**base.to_dict(), **given})


class NamedRunner:
    """A pagoda variant under its own name (PagodaRunner is always "pagoda")."""

    def __init__(self, name: str, runner):
        self.name, self.runner = name, runner

    def run(self, prompts):
        return self.runner.run(prompts)

    def report(self) -> dict:
        return self.runner.report()

    def close(self) -> None:
        self.runner.close()


def run(args: argparse.Namespace) -> int:
    from ops.bench.peers import LlamaCppPeer, VllmPeer
    from ops.bench.throughput import PagodaRunner, run_alternating
    from shared.engine_args import EngineArgs
    from shared.tokenizer import get_tokenizer
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    base = EngineArgs.from_cli_args(args)
    config = base.create_engine_config()
    tokenizer = get_tokenizer(config.model_config.tokenizer)
    rounds = [make_workload(config.model_config.vocab_size, set(tokenizer.all_special_ids), 1,
                            args.input_len, args.seed + r) for r in range(args.rounds + 1)]
    variants = [variant_args(base, v) for v in (args.variant or ["pagoda="])]
    print(f"single stream: {args.input_len} prompt tokens -> {args.output_len} greedy tokens, "
          f"1 + {args.rounds} rounds; pagoda: {', '.join(n for n, _ in variants)}", flush=True)
    systems = []
    try:
        for name, engine_args in variants:
            print(f"loading pagoda {name}", flush=True)
            systems.append(NamedRunner(name, PagodaRunner(engine_args, args.output_len,
                                                          rounds[0])))
        if "vllm" in args.baseline:
            systems.append(VllmPeer(args.vllm_python, config, args.output_len, rounds))
        if "llama.cpp" in args.baseline:
            if not args.gguf:
                raise SystemExit("--baseline llama.cpp needs --gguf FILE")
            for path in args.gguf:
                systems.append(LlamaCppPeer(args.llama_cpp_python, path, args.output_len,
                                            args.input_len + args.output_len + 8,
                                            name=f"llama.cpp {_short(path)}"))
        # Each round is one prompt, so run_alternating's "workload" is the rounds themselves.
        from ops.bench.workloads import Workload
        workload = Workload("single", rounds, "1 prompt per round")
        results = run_alternating(systems, [workload])["single"]
    finally:
        for system in systems:
            system.close()
    reference = args.reference or ("vllm" if "vllm" in results else None)
    summary = summarize(results, args.output_len, reference)
    print_summary(summary, reference)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"input_len": args.input_len, "output_len": args.output_len,
                       "rounds": args.rounds, "engine_args": base.to_dict(),
                       "systems": summary}, f, indent=2, default=str)
        print(f"saved {args.output_json}")
    return 0


def _short(path: str) -> str:
    import os
    return os.path.basename(path).removesuffix(".gguf")


def summarize(results: dict[str, dict], output_len: int, reference: str | None) -> dict:
    """Per system: the first round's and every warm round's output tok/s, the warm median, and
    against the reference each warm round's ratio and their median."""
    summary = {}
    for name, r in results.items():
        rates = [output_len / s for s in r["runs_s"]]
        summary[name] = {"first_tok_s": rates[0], "warm_tok_s": rates[1:],
                         "median_tok_s": statistics.median(rates[1:]),
                         "info": {k: v for k, v in r.items()
                                  if k not in ("runs_s", "elapsed_s")}}
    if reference is not None:
        if reference not in summary:
            raise SystemExit(f"--reference {reference!r} did not run ({', '.join(summary)})")
        ref = summary[reference]["warm_tok_s"]
        for s in summary.values():
            ratios = [a / b for a, b in zip(s["warm_tok_s"], ref)]
            s["ratio_by_round"] = ratios
            s["ratio"] = statistics.median(ratios)
    return summary


def print_summary(summary: dict, reference: str | None) -> None:
    for name, s in summary.items():
        line = (f"{name}: {s['median_tok_s']:.1f} output tok/s warm (rounds "
                f"{', '.join(f'{x:.1f}' for x in s['warm_tok_s'])}); first request "
                f"{s['first_tok_s']:.1f}")
        if reference is not None and name != reference:
            line += (f"; / {reference}: {s['ratio']:.2f}x (by round "
                     f"{', '.join(f'{x:.2f}' for x in s['ratio_by_round'])})")
        print(line)
