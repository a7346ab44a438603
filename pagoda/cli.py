"""The `pagoda` command: `pagoda serve`, `pagoda bench ...`, `pagoda generate`, and one
subcommand per service process. Each subcommand lives in its own module and is imported lazily,
so `pagoda --help` is fast."""
import argparse
import importlib
import sys

# subcommand -> (module, help); each module has `add_arguments(parser)` and `run(args)`.
COMMANDS = {
    "generate": ("ops.generate_cli", "generate text for prompts with the offline engine"),
    "bench": ("ops.bench.cli", "benchmarks: throughput (offline or through the stack), serve"),
    "engine": ("services.engine.main", "run the engine service (scheduler + step loop)"),
    "worker": ("services.worker.main", "run a worker service (model + KV cache + sampler)"),
    "tokenizer": ("services.tokenizer.main", "run a tokenizer service"),
    "detokenizer": ("services.detokenizer.main", "run a detokenizer service"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        modules[name] = module
    args = parser.parse_args(argv)
    sys.exit(modules[args.command].run(args) or 0)
