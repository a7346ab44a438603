"""The GPU check: one run on a GPU machine that measures what docs/benchmarks.md's "GPU check
(H200)" section asks for, and prints one table (also written as gpu_check.json and gpu_check.md
under $OUT, or ops/results/ when OUT is unset, after every section).

Sections, in order, each catching its own errors (a failed one is a FAILED row, the rest run):
  env         the GPU, the versions, the copy bandwidth and the bf16 matmul rate   (env.py)
  kernels     the Triton kernels against their torch references, then timed
              (kernel_checks.py, kernel_timing.py, kernel_inputs.py, sampling_checks.py;
              the int8 / w8a8 matmuls and their decode timing: int8_checks.py)
  parity      the engine's greedy tokens against transformers on random models  (parity.py;
              on CUDA also --quantization int8 / w8a8 against unquantized, int8_checks.py)
  throughput  offline throughput at the 1B and 8B shapes against transformers' static
              batching and a roofline                     (throughput.py, roofline.py)
  graphs      (after the 1B throughput) small-batch decode step time, CUDA graphs against
              --enforce-eager, and their greedy tokens compared                (graphs.py)
  serve       `pagoda serve` under `pagoda bench serve` on the 1B random model    (serve.py)
The plan of a run is plan.py, its rows and report report.py, the timing measure.py, the random
models random_models.py, the arguments, order and watchdog cli.py.

`--device cpu` is the smoke mode: tiny shapes and models, the kernels under Triton's interpreter
(TRITON_INTERPRET=1, set when missing), no serve; tests/test_gpu_check.py runs it. A watchdog
prints the table and exits once `--deadline-s` has passed.

    python -m ops.bench.gpu_check [--quick] [--skip-serve] ...   # ops/gpu_check.sh on a GPU
"""
from .roofline import kv_bytes_per_token, matmul_params, model_shape, roofline_seconds

__all__ = ["kv_bytes_per_token", "matmul_params", "model_shape", "roofline_seconds"]
