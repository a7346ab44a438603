"""`pagoda bench throughput` on a tiny workload: pagoda and the transformers baseline both run
it, each as many times as asked with fresh prompts, and the report holds what they measured."""
import argparse
import json

from ops.bench import throughput


def test_bench_throughput_runs_both_systems_repeatedly_and_reports_the_ratio(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                              "--repeats", "2", "--baseline", "hf", "--max-model-len", "64",
                              "--output-json", str(out)])
    assert throughput.run(args) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["repeats"] == 2
    for system in ("pagoda", "hf"):
        r = result[system]
        assert r["output_tokens"] == 3 * 4  # ignore_eos: every prompt runs to its length
        assert len(r["runs_s"]) == 2 and all(t > 0 for t in r["runs_s"])
        assert min(r["runs_s"]) <= r["elapsed_s"] <= max(r["runs_s"])
        assert r["output_tok_s"] == r["output_tokens"] / r["elapsed_s"]
        assert r["total_tok_s"] == (3 * 8 + 3 * 4) / r["elapsed_s"]
    assert result["ratio_output_tok_s"] == (result["pagoda"]["output_tok_s"]
                                            / result["hf"]["output_tok_s"])
    assert result["matmul_gflops"] > 0 and 0 < result["pagoda"]["fraction_of_matmul_peak"] < 1
    printed = capsys.readouterr().out
    assert "ratio pagoda / transformers" in printed and "runs:" in printed


def test_repeats_get_fresh_prompts():
    first, second = (throughput.make_workload(1000, {0, 1}, 4, 16, seed) for seed in (0, 1))
    assert first != second
    assert first == throughput.make_workload(1000, {0, 1}, 4, 16, 0)
    assert all(t not in (0, 1) for p in first + second for t in p)
