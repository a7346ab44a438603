#!/usr/bin/env bash
# The GPU check on a device machine (docs/benchmarks.md, "GPU check (H200)"): installs the
# wheels carried in .whl/ (ops/gpu_wheels.sh fetches them), then runs ops/bench/gpu_check/
# under a time limit, its log kept in $OUT when that is set. Arguments go to the script, e.g.
#   bash ops/gpu_check.sh --quick --skip-serve
# --quantization int8 / w8a8 is in its kernels section (the Triton int8 matmuls against the
# float64 reference, timed at decode and prompt shapes against bf16) and its parity section
# (the engine quantized against unquantized); only those two:
#   bash ops/gpu_check.sh --quick --skip-throughput --skip-graphs --skip-serve
set -euo pipefail
cd "$(dirname "$0")/.."

SITE=/tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# 470 s: the script's own deadline (--deadline-s, 450 by default) prints the table first.
run() { timeout 470 python3 -m ops.bench.gpu_check "$@"; }
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  run "$@" 2>&1 | tee "$OUT/gpu_check.log"
else
  run "$@"
fi
