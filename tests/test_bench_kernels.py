"""`pagoda bench kernels` runs every op on both sides and reports what it measured; the vLLM
baseline of `bench throughput` says what it needs when it is missing."""
import argparse
import json

import pytest

from ops.bench import kernels, peers


def test_bench_kernels_times_every_op_on_both_sides(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    args = parser.parse_args(["--dtype", "bfloat16", "--batch", "2", "--context", "40",
                              "--repeats", "1", "--output-json", str(out)])
    assert kernels.run(args) == 0
    results = json.loads(out.read_text())["results"]
    ops = {r["op"] for r in results}
    assert ops == {"decode attention", "residual + RMSNorm", "rotary",
                   "matmuls (layers + LM head)", "greedy sampling"}
    assert all(r["dtype"] == "bfloat16" and r["torch_ms"] > 0 and r["kernels_ms"] > 0
               for r in results)
    printed = capsys.readouterr().out
    assert "all of the above" in printed and printed.count("x\n") == len(ops) + 1


def test_vllm_baseline_without_its_python_is_a_clear_error():
    with pytest.raises(SystemExit, match="--vllm-python"):
        peers.VllmPeer(None, None, 4, [[[1, 2]]])
