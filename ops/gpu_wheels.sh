#!/usr/bin/env bash
# Downloads, here (where pip reaches PyPI), the wheels that the H200 device machine lacks for
# pagoda, into .whl/ (ignored by git), for ops/gpu_check.sh to install there. The machine has
# torch, triton, transformers, safetensors, numpy, msgpack, prometheus-client, pyyaml, tqdm,
# httpx, anyio, h11 and click (/work/.library/device/KINDS.md), but none of:
#   pyzmq, structlog                      every process: sockets, logging (shared/logging.py)
#   pydantic (+ core, annotated-types,    the gateway's request schemas
#     typing-inspection, typing-extensions: pydantic-core needs >= 4.16)
#   fastapi, starlette, opentelemetry-api the gateway's app
#   uvicorn                               the gateway's server
#   openai (+ httpx2, httpcore2,          `pagoda bench serve --client openai` (its default, httpx, is there)
#     truststore, jiter, sniffio)
# Versions are the ones this project's venv runs its tests with. gguf is left out: only GGUF
# models need it, and the GPU check builds Hugging Face folders.
# Usage (repository root): bash ops/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEELS=(
  pyzmq==27.3.0
  structlog==26.1.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  fastapi==0.165.0
  starlette==1.10.0
  opentelemetry-api==1.45.2
  uvicorn==0.54.0
  openai==3.57.0
  httpx2==2.16.2
  httpcore2==2.16.2
  truststore==0.10.5
  jiter==0.19.0
  sniffio==1.3.1
)

mkdir -p .git/info
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl

# The device README's line: CPython 3.12 wheels for the manylinux platforms that machine takes.
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"

echo "wheels in .whl/:"
ls -1 .whl
du -sh .whl
