"""ops/bench/gpu_check/: its smoke mode on the CPU (tiny shapes, the Triton kernels under the
interpreter, no serve) runs every section without a failure, and the roofline is the arithmetic
its docstring states. The real run needs a GPU (docs/benchmarks.md, "GPU check (H200)")."""
import json
import os
import subprocess
import sys

import pytest

from ops.bench import gpu_check

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_roofline_takes_the_longer_of_bytes_and_flops_per_step():
    shape = dict(hidden=8, inter=16, layers=1, heads=2, kv_heads=1, head_dim=4, vocab=32)
    weights = gpu_check.matmul_params(shape)
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16, head 8x32
    assert weights == 64 + 64 + 64 + 384 + 256
    kv_token = gpu_check.kv_bytes_per_token(shape, 2)
    assert kv_token == 2 * 1 * 4 * 2
    # Memory-bound at this rate: FLOPs are free, bytes cost 1 s each.
    memory_bound = gpu_check.roofline_seconds(shape, 3, 5, 3, 2, bytes_per_s=1.0,
                                              flop_per_s=1e30)
    prefill = 3 * 5 * kv_token
    # Waves of 2 and 1 sequences, 2 decode steps each, contexts 6 and 7.
    decode = sum(2 * weights + batch * context * kv_token
                 for batch in (2, 1) for context in (6, 7))
    assert memory_bound == pytest.approx(prefill + decode)
    compute_bound = gpu_check.roofline_seconds(shape, 1, 4, 1, 8, bytes_per_s=1e30,
                                               flop_per_s=1.0)
    pair_flops = 4 * 2 * 4
    assert compute_bound == pytest.approx(4 * 2 * weights + pair_flops * 4 * 5 / 2)


def test_the_smoke_mode_runs_every_section_on_the_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, "-m", "ops.bench.gpu_check", "--device", "cpu",
                           "--results-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "gpu_check.json") as f:
        result = json.load(f)
    rows = result["rows"]
    assert result["meta"]["finished"]
    assert {r["section"] for r in rows} == {"env", "kernels", "parity", "throughput", "graphs",
                                            "serve"}
    assert not [r for r in rows if r["verdict"] in ("FAILED", "MISMATCH")]
    checks = {r["check"]: r for r in rows}
    for kernel in ("paged_decode_attention", "prefill_attention", "write_kv_cache", "rotary_"):
        assert checks[f"{kernel}: correctness"]["verdict"] == "ok"
    assert checks["serve"]["verdict"] == "skipped"
    # No graphs on the CPU: both modes run eagerly, so their tokens must be identical.
    assert checks["greedy tokens, graphs vs eager"]["result"].startswith(
        "2 sequences: 2 identical")
    # Async scheduling against none: the same tokens, and a step time for each.
    assert checks["greedy tokens, synchronous vs graphs"]["result"].startswith(
        "2 sequences: 2 identical")
    assert " ms vs " in checks["decode step at batch 2, async scheduling vs synchronous"]["result"]
    assert (tmp_path / "gpu_check.md").read_text().count("\n| ") == len(rows) + 1
    assert "| throughput | tiny pagoda / transformers" in done.stdout  # the printed table
