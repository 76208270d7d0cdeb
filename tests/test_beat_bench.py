"""The beat benchmark at a small size: output structure and that jitter flattens the peak."""

from __future__ import annotations

import pytest

import redis

from devtools.bench.beat import format_report, run_bench, window_stats
from gateway_tasks.local.redis_server import EmbeddedRedis
from devtools.measure import percentile


def test_small_bench(settings):
    # a private server: the memory per entry is a delta of the server's used_memory, which
    # other tests' writes and deletes on a shared Redis move either way
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        try:
            result = run_bench(r, settings, entries=2000, crons_per_tenant=20, batch_size=500)
        finally:
            r.close()
    assert result["entries"] == 2000 and result["tenants"] == 100
    off, on = result["modes"]["jitter_off"], result["modes"]["jitter_on"]
    for mode in (off, on):
        assert mode["fired"] == 2000 and mode["statuses"] == {"fired": 2000}
        assert set(mode) >= {"overall", "tiers", "histogram_per_s", "ticks",
                             "dispatch_lag_replayed_ms", "memory", "timings_s"}
        assert sum(mode["histogram_per_s"].values()) == 2000
        assert set(mode["tiers"]) == {"vip", "normal", "batch"}
        assert mode["ticks"]["busy_tick_ms_p99"] > 0
        assert mode["memory"]["used_memory_delta_per_entry_b"] > 0
        assert mode["memory"]["hash_memory_usage_mean_b"] > 0
    assert off["overall"]["peak_per_s"] == 2000 and off["overall"]["peak_second"] == 0
    assert on["overall"]["peak_per_s"] < off["overall"]["peak_per_s"]
    assert on["tiers"]["vip"]["fired"] == 200 and on["tiers"]["vip"]["peak_per_s"] == 200
    assert on["tiers"]["batch"]["window_s"] == 600 and on["tiers"]["normal"]["window_s"] == 120
    # every jittered run lands inside its tier's window
    hist = on["histogram_per_s"]
    assert sum(v for s, v in hist.items() if int(s) < 0 or int(s) >= 600) == 0
    text = format_report(result)
    assert "peak fires/s" in text and "batch (free)" in text
    assert text.splitlines()[-1] == f"bench took {result['elapsed_s']:.0f} s"


def test_helpers():
    assert percentile([], 99, default=0.0) == 0.0
    with pytest.raises(ValueError):
        percentile([], 99)
    assert percentile(list(range(1, 101)), 99) == 99.0
    assert percentile([5.0], 50) == 5.0
    assert window_stats({0: 10, 1: 30}, 2) == {"window_s": 2, "fired_in_window": 40,
                                               "peak_per_s": 30, "mean_per_s": 20.0,
                                               "peak_over_mean": 1.5}
    assert window_stats({0: 7}, 0)["peak_over_mean"] == 1.0
