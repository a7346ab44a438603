"""`pagoda bench spec`'s flags: the engine flags reach both engines; the speculative config only
the second. (Its measurement runs on loaded engines in tests/test_spec_decode.py.)"""
import argparse
import json

import pytest

from ops.bench import spec


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_bench_spec_takes_the_engine_flags_for_both_engines():
    args = parse("--rounds", "1", "--max-model-len", "512", "--max-num-seqs", "4",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    engines = spec.engine_args(args)
    assert set(engines) == {"plain", "speculative"}
    for e in engines.values():
        assert e.max_model_len == 512 and e.max_num_seqs == 4 and e.kv_cache_space_gib == 0.5
    assert engines["plain"].speculative_config is None
    assert json.loads(engines["speculative"].speculative_config)["num_speculative_tokens"] == 2
    # Without the flag: n-gram lookup, k = 4.
    default = spec.engine_args(parse()).get("speculative").speculative_config
    assert json.loads(default) == {"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with pytest.raises(SystemExit):
        spec.engine_args(parse("--speculative-config", ""))
