"""`pagoda bench latency`: single-stream rounds on pagoda variants and the llama.cpp peer's
protocol (ops/bench/llama_cpp_peer.py run by a real second interpreter; only llama.cpp itself is
a stand-in, which yields tokens forever as `Llama.generate` does, and logs what it was asked)."""
import argparse
import json
import textwrap

import pytest

from ops.bench import latency

FAKE_LLAMA_CPP = """
import json, os
__version__ = "0.0-stand-in"
LOG = os.environ["FAKE_LLAMA_LOG"]

def _log(**entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\\n")

def llama_print_system_info():
    return b"AVX512 = 1"

class Llama:
    def __init__(self, **kwargs):
        _log(init=kwargs)

    def generate(self, tokens, top_k, top_p, temp, reset):
        _log(generate=list(tokens), top_k=top_k, reset=reset)
        while True:  # the caller stops it
            yield 7
"""


def test_latency_runs_each_round_alone_on_every_system(tmp_path, monkeypatch, capsys):
    package = tmp_path / "fake" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_LLAMA_CPP))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    import sys
    parser = argparse.ArgumentParser()
    latency.add_arguments(parser)
    out = tmp_path / "latency.json"
    args = parser.parse_args([
        "--rounds", "2", "--input-len", "6", "--output-len", "5",
        "--variant", "one=--max-num-seqs 1",
        "--baseline", "llama.cpp", "--llama-cpp-python", sys.executable,
        "--gguf", "/models/stand-in.gguf", "--reference", "llama.cpp stand-in",
        "--max-model-len", "64", "--output-json", str(out),
        "--kv-cache-space-gib", "0.1"])  # not the 2 GiB default: its zero-fill takes ~14 s here
    assert latency.run(args) == 0
    systems = json.loads(out.read_text())["systems"]
    assert list(systems) == ["one", "llama.cpp stand-in"]
    for s in systems.values():
        assert len(s["warm_tok_s"]) == 2 and s["first_tok_s"] > 0
        assert s["median_tok_s"] == pytest.approx(sorted(s["warm_tok_s"])[1] / 2
                                                  + sorted(s["warm_tok_s"])[0] / 2)
    assert systems["llama.cpp stand-in"]["ratio"] == pytest.approx(1.0)
    assert systems["one"]["info"]["output_tokens"] == 5  # one prompt, 5 tokens, ignoring EOS
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    init = calls[0]["init"]
    assert init["model_path"] == "/models/stand-in.gguf" and init["n_ctx"] >= 6 + 5
    prompts = [c["generate"] for c in calls[2:]]  # after the load and the warm-up
    # Every round's one prompt, each run alone from a fresh state, greedy.
    assert len(prompts) == 3 and all(len(p) == 6 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 3  # fresh tokens each round
    assert all(c["reset"] and c["top_k"] == 1 for c in calls[1:])
    printed = capsys.readouterr().out
    assert "one: " in printed and "/ llama.cpp stand-in:" in printed


def test_a_variant_needs_a_name_and_valid_flags():
    from shared.engine_args import EngineArgs
    name, engine_args = latency.variant_args(EngineArgs(max_model_len=64),
                                             "int8=--quantization int8")
    assert name == "int8" and engine_args.quantization == "int8"
    assert engine_args.max_model_len == 64  # the base flags stay under the variant's
    with pytest.raises(SystemExit):
        latency.variant_args(EngineArgs(), "=--quantization int8")
