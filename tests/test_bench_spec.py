"""`pagoda bench spec`, tiny: one round of one prompt, a few tokens, both engines."""
import argparse
import json

from ops.bench import spec


def test_bench_spec_reports_both_rates_the_ratio_and_acceptance(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    out = tmp_path / "spec.json"
    args = parser.parse_args(["--rounds", "1", "--num-prompts", "1", "--output-len", "12",
                              "--kv-cache-space-gib", "0.1", "--output-json", str(out)])
    assert spec.run(args) == 0
    result = json.loads(out.read_text())
    assert result["same_tokens"] is True
    assert all(len(v) == 1 and v[0] > 0 for v in result["output_tok_s"].values())
    assert result["ratio_of_medians"] == (result["median_output_tok_s"]["speculative"]
                                          / result["median_output_tok_s"]["plain"])
    # The rewrite prompt repeats code from the prompt: lookup finds it and some is accepted.
    assert result["acceptance_rate"] > 0 and result["mean_accepted_length"] > 1
    printed = capsys.readouterr().out
    assert "ratio" in printed and "acceptance rate" in printed
