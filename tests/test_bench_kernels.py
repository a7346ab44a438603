"""`pagoda bench kernels` runs every op on both sides and `bench matmuls` every fp32 layout on
each shape, each reporting what it measured; the vLLM baseline of `bench throughput` says what it
needs when it is missing."""
import argparse
import json

import pytest
import torch

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


def test_bench_matmuls_times_every_fp32_layout_on_each_shape(tmp_path, capsys):
    from pagoda_kernels import cpu
    from ops.bench import matmuls
    from services.worker.models.linear import _onednn
    out = tmp_path / "matmuls.json"
    parser = argparse.ArgumentParser()
    matmuls.add_arguments(parser)
    args = parser.parse_args(["--shape", "3x64x40", "9x96x32", "--repeats", "2",
                              "--output-json", str(out)])
    assert matmuls.run(args) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["n"], r["k"]) for r in results] == [(3, 64, 40), (9, 96, 32)]
    expected = ({"mkl [in, out]"} | ({"onednn"} if _onednn(torch.float32) else set())
                | {f"panels {h} rows" for h in cpu.f32_block_rows()})
    assert all(set(r["gflops"]) == expected and min(r["gflops"].values()) > 0 for r in results)
    assert capsys.readouterr().out.count("3x64x40: ") == 1


def test_bench_matmuls_refuses_a_shape_it_cannot_read():
    from ops.bench import matmuls
    with pytest.raises(SystemExit, match="ROWSxNxK"):
        matmuls._parse("64x960")
