"""The `pagoda` command: `pagoda serve`, `pagoda bench ...`, `pagoda generate`, and one
subcommand per service process. Each subcommand lives in its own module and is imported lazily,
so `pagoda --help` is fast."""
import argparse
import importlib
import sys

# subcommand -> (module, help); each module has `add_arguments(parser)` and `run(args)`.
COMMANDS = {
    "serve": ("ops.serve_cli", "run the whole stack of docker-compose.yml as local processes"),
    "health": ("ops.health_cli", "probe a service's control socket; exit 0 when it is ready"),
    "generate": ("ops.generate_cli", "generate text for prompts with the offline engine"),
    "bench": ("ops.bench.cli", "benchmarks: throughput (offline or through the stack), serve, kernels"),
    "keys": ("ops.keys_cli", "create CurveZMQ keys for a stack whose services talk across hosts"),
    "engine": ("services.engine.main", "run the engine service (scheduler + step loop)"),
    "worker": ("services.worker.main", "run a worker service (model + KV cache + sampler)"),
    "tokenizer": ("services.tokenizer.main", "run a tokenizer service"),
    "detokenizer": ("services.detokenizer.main", "run a detokenizer service"),
    "gateway": ("services.gateway.main", "run the OpenAI-compatible HTTP gateway"),
}
SERVICES = {"engine", "worker", "tokenizer", "detokenizer", "gateway"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="pagoda", description="pagoda: LLM inference as ZeroMQ + msgpack microservices")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    if chosen in SERVICES:
        # Before the service's module imports torch: OpenMP reads its settings once, at load.
        from shared.placement import PlacementError, apply_placement
        try:
            apply_placement(chosen)
        except PlacementError as e:
            sys.exit(f"pagoda {chosen}: {e}")
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen subcommand's module is imported (health probes stay fast)
            module = importlib.import_module(module_name)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    sys.exit(module.run(args) or 0)
