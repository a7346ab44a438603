"""`pagoda bench serve`'s statistics and plot (the HTTP side runs in tests/test_gateway.py's
stack and in the benchmark itself)."""
import math

import pytest

from ops.bench.serve import RequestResult, _stats_ms, save_plot, summarize


def test_percentiles_interpolate_between_closest_ranks():
    stats = _stats_ms([0.001 * v for v in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)


def test_summary_counts_failures_and_rates_over_the_run():
    done = RequestResult(ok=True, ttft=0.5, latency=2.5, output_tokens=5, itl=[0.5] * 4)
    failed = RequestResult(ok=False, error="APIError: boom")
    s = summarize(2.0, [done, done, failed], duration=10.0, input_len=64)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["APIError: boom"])
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["output_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx((10 + 128) / 10)
    assert s["tpot_ms"]["mean"] == pytest.approx(500.0)  # (2.5 - 0.5) / (5 - 1)
    assert s["ttft_ms"]["p99"] == pytest.approx(500.0)


def test_infinite_rate_is_reported_as_inf():
    assert summarize(math.inf, [], duration=1.0, input_len=1)["request_rate"] == "inf"


def test_plot_of_several_rates_is_a_png(tmp_path):
    result = RequestResult(ok=True, ttft=0.2, latency=1.0, output_tokens=3, itl=[0.4, 0.4])
    summaries = [summarize(r, [result], 1.0, 8) for r in (1.0, 4.0, math.inf)]
    path = tmp_path / "latency.png"
    save_plot(str(path), summaries, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
