"""Predictive scaling from history: the pure maths (minutes of the same time of day,
the percentile, the cron schedule's busiest minute in the window, the combination,
the peak multiplier) table-tested; then the demand every enqueue records in a real
Redis, read back as the forecast, exported as a metric and printed by
`gateway capacity forecast`."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_tasks.capacity.forecast import Forecast, Series
from gateway_tasks.capacity.history import (DemandForecast, cells_of, cron_busiest_minute, forecast_of,
                                            minute_of, peak_multiplier, percentile, read_forecast,
                                            read_minutes, same_time_minutes)
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import DEMAND_RETENTION_S, Keys, demand_fields
from gateway_tasks.core.tokens import count_prompt_tokens
from gateway_tasks.metrics.exporter import render
from gateway_tasks.producer.gateway import Gateway

DAY = 1440
T0 = 1_767_225_600_000            # 2026-01-01T00:00:00Z
NOW_MIN = T0 // 60_000


# -- pure ---------------------------------------------------------------------------------
@pytest.mark.parametrize("days,lead_from,lead_to,expected", [
    (1, 5, 10, [NOW_MIN - DAY + k for k in range(5, 11)]),
    (2, 0, 0, [NOW_MIN - DAY, NOW_MIN - 2 * DAY]),
    (7, 5, 10, [NOW_MIN + k - d * DAY for d in range(1, 8) for k in range(5, 11)]),
])
def test_same_time_minutes(days, lead_from, lead_to, expected):
    assert same_time_minutes(NOW_MIN, days, lead_from, lead_to) == expected


def test_the_default_window_is_42_minutes_of_the_last_7_days():
    minutes = same_time_minutes(NOW_MIN)
    assert len(minutes) == 42 and min(minutes) == NOW_MIN - 7 * DAY + 5 and max(minutes) == NOW_MIN - DAY + 10


@pytest.mark.parametrize("values,q,expected", [
    ([], 95, 0.0),
    ([7], 95, 7.0),
    (list(range(1, 11)), 95, 9.55),          # numpy.percentile(range(1, 11), 95)
    (list(range(1, 11)), 50, 5.5),
    (list(range(1, 11)), 100, 10.0),
    (list(range(1, 11)), 0, 1.0),
    ([0] * 36 + [60, 60, 60, 60, 60, 600], 95, 60.0),   # one day's 6 busy minutes, one spike
    ([0] * 41 + [100], 95, 0.0),                          # a single outlier minute is not the P95
    ([5, 1, 3], 50, 3.0),                                 # order does not matter
])
def test_percentile_table(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


@pytest.mark.parametrize("call", [lambda: percentile([1], 101), lambda: same_time_minutes(NOW_MIN, 0),
                                  lambda: same_time_minutes(NOW_MIN, 7, 10, 5),
                                  lambda: peak_multiplier([1.0], 0)])
def test_bad_window_is_a_config_error(call):
    with pytest.raises(ConfigError):
        call()


def _fc(bucket_s: int, runs: list[int], tokens: list[int], start_ms: int = T0) -> Forecast:
    fc = Forecast(start_ms, bucket_s, len(runs))
    fc.series[("default", "normal")] = Series(runs, tokens)
    return fc


@pytest.mark.parametrize("fc,expected", [
    (None, (0.0, 0.0)),
    # 60 s bins from now: minutes 5..10 are bins 5..10; bin 4 (and 11) fall outside
    (_fc(60, [0, 0, 0, 0, 99, 3, 1, 0, 0, 0, 7, 99], [0, 0, 0, 0, 9e5, 300, 100, 0, 0, 0, 700, 9e5]),
     (7.0, 700.0)),
    (_fc(60, [5] * 5, [50] * 5), (0.0, 0.0)),             # a 5-minute horizon does not reach minute 5
    (_fc(300, [0, 10, 2], [0, 1000, 200]), (2.0, 200.0)),  # a 300 s bin's counts per minute
    (_fc(60, [1] * 12, [10] * 12, start_ms=T0 - 2 * 60_000), (1.0, 10.0)),   # published 2 min ago
])
def test_cron_busiest_minute_in_the_lead_window(fc, expected):
    assert cron_busiest_minute(fc, "default", "normal", T0) == expected
    assert cron_busiest_minute(fc, "default", "vip", T0) == (0.0, 0.0)


@pytest.mark.parametrize("history_r,cron_runs,expected_r", [
    ([0] * 36 + [60] * 6, [0] * 12, 60.0),     # history alone
    ([0] * 42, [0] * 5 + [120] + [0] * 6, 120.0),   # a new cron storm history has not seen
    ([100] * 42, [0] * 5 + [20] + [0] * 6, 100.0),  # interactive traffic over a small cron
])
def test_forecast_is_the_larger_of_history_and_schedule(history_r, cron_runs, expected_r):
    fc = _fc(60, cron_runs, [r * 10 for r in cron_runs])
    d = forecast_of("default", "normal", history_r, [r * 10 for r in history_r], fc, T0)
    assert d.requests == pytest.approx(expected_r) and d.tokens == pytest.approx(expected_r * 10)
    assert d.samples == 42 and d.as_dict()["requests_per_minute"] == d.requests


@pytest.mark.parametrize("per_minute,window_s,expected", [
    ([0.0] * 120, 300, None),
    ([10.0] * 60, 300, (10 / 60) / (600 / 300)),             # flat: the hour spread over the hour
    ([0.0] * 55 + [300.0] * 5, 300, (300 / 60) / (1500 / 300)),  # all in 5 minutes = the window: 1.0
    ([0.0] * 59 + [600.0], 300, (600 / 60) / (600 / 300)),   # all in one minute: 5x the even spread
    ([5.0] * 60 + [0.0] * 59 + [600.0], 300, 5.0),           # the busiest minute's hour decides
])
def test_peak_multiplier_from_history(per_minute, window_s, expected):
    got = peak_multiplier(per_minute, window_s)
    assert got == (pytest.approx(expected) if expected is not None else None)


# -- recorded by every enqueue, read back, exported and printed ---------------------------------
PROMPT = [{"role": "user", "content": "What changed since yesterday?"}]


def _seed(r, keys: Keys, pool: str, tier: str, minute: int, requests: int, tokens: int) -> None:
    hour, m = divmod(minute, 60)
    rf, tf = demand_fields(m)
    r.hset(keys.demand(pool, tier, hour), mapping={rf: requests, tf: tokens})


@pytest.fixture
def cli_env(monkeypatch, redis_url, key_prefix):
    """`gateway` commands on this test's deployment (the process-wide settings reloaded)."""
    from gateway_tasks.core.settings import get_settings

    monkeypatch.delenv("GATEWAY_CONFIG", raising=False)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("GATEWAY_KEY_PREFIX", key_prefix)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_enqueues_record_demand_and_the_forecast_reads_it(r, settings, capsys, cli_env):
    keys, pool = Keys(settings.key_prefix), settings.pools[0].name
    gw = Gateway(settings)
    try:
        gw.register_tenant("acme", "normal")
        gw.register_tenant("bigco", "vip")
        for _ in range(3):
            gw.submit("acme", PROMPT, max_tokens=100)
        gw.submit("bigco", PROMPT, max_tokens=50)
    finally:
        gw.app.close()
    est = count_prompt_tokens(PROMPT)
    recorded = {}
    for key in r.scan_iter(match=f"{settings.key_prefix}*demand:*"):
        name = key.decode()
        ttl = r.ttl(key)
        assert 0 < ttl <= DEMAND_RETENTION_S and r.object("encoding", key) in (b"listpack", b"ziplist")   # Redis 7 / 6.2
        fields = {k.decode(): int(v) for k, v in r.hgetall(key).items()}
        recorded[name.rsplit(":", 2)[1]] = (sum(v for f, v in fields.items() if f[0] == "r"),
                                           sum(v for f, v in fields.items() if f[0] == "t"))
    assert recorded == {"normal": (3, 3 * (est + 100)), "vip": (1, est + 50)}

    # seven days of history in the window 5-10 minutes ahead: normal busy on two days
    now_ms = int(r.time()[0]) * 1000
    now_min = minute_of(now_ms)
    for minute in same_time_minutes(now_min):
        day = (now_min - minute) // DAY + 1
        _seed(r, keys, pool, "normal", minute, 40 if day in (1, 2) else 4, 400 if day in (1, 2) else 40)
    cells = cells_of([pool], ["vip", "normal", "batch"])
    demand = {d.tier: d for d in read_forecast(r, keys, cells, now_ms, None)}
    assert demand["normal"].history_requests == pytest.approx(40.0)       # 12 of 42 minutes busy
    assert demand["normal"].tokens == pytest.approx(400.0) and demand["batch"].requests == 0
    assert read_minutes(r, keys, cells, now_min + 5 - DAY, 3) == [40.0, 40.0, 40.0]

    got = {}
    for fam in text_string_to_metric_families(render(r, settings).decode()):
        for s in fam.samples:
            got[(s.name, frozenset(s.labels.items()))] = s.value
    label = {"pool": pool, "tier": "normal", "source": "combined"}
    assert got[("gateway_demand_forecast_requests_per_minute", frozenset(label.items()))] == pytest.approx(40.0)
    assert got[("gateway_demand_forecast_tokens_per_minute",
                frozenset({**label, "source": "history"}.items()))] == pytest.approx(400.0)

    from gateway_tasks.cli.main import main
    assert main(["capacity", "forecast", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    normal = next(d for d in doc["demand"] if d["tier"] == "normal")
    assert normal["history_p95_requests_per_minute"] == pytest.approx(40.0) and normal["history_minutes"] == 42
    assert main(["capacity", "forecast"]) == 0
    text = capsys.readouterr().out
    assert "demand forecast 5-10 minutes ahead" in text and "normal" in text


def test_a_demand_forecast_is_plain_data():
    d = DemandForecast("p", "vip", 1.0, 10.0, 2.0, 5.0, 42)
    assert (d.requests, d.tokens) == (2.0, 10.0)


def test_capacity_from_the_deployment_fills_the_tenant_model_and_flags_win(r, settings, capsys, cli_env):
    from gateway_tasks.cli.main import main
    from gateway_tasks.core.errors import EXIT_CONFIG
    from gateway_tasks.core.stats import COMPLETED, UPSTREAM_MS, tier_field

    keys, pool = Keys(settings.key_prefix), settings.pools[0].name
    command = ["capacity", "--from-deployment", "--p99-target-ms", "3000", "--json"]
    assert main(command) == EXIT_CONFIG                      # nothing measured, nothing registered
    assert "--inference-ms is required with --from-deployment (no upstream call" in capsys.readouterr().err
    assert main([*command, "--inference-ms", "800"]) == EXIT_CONFIG
    assert "--tenants is required with --from-deployment (no tenant is registered)" in capsys.readouterr().err

    r.sadd(keys.tenants, "a", "b", "c", "d")
    now_min = minute_of(int(r.time()[0]) * 1000)
    _seed(r, keys, pool, "normal", now_min - 30, 12, 1200)            # the last hour: 3 per tenant
    busy_hour = (now_min - 2 * DAY) // 60 * 60                         # two days ago, one clock hour:
    _seed(r, keys, pool, "batch", busy_hour + 10, 50, 5000)            # 50 requests in one minute,
    _seed(r, keys, pool, "vip", busy_hour + 20, 10, 1000)              # 10 more in the hour
    r.hset(keys.stats(pool), mapping={tier_field(COMPLETED, "vip"): 10, tier_field(UPSTREAM_MS, "vip"): 8000})

    assert main(command) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["tenants"] == 4 and doc["inputs"]["tasks_per_tenant_per_hour"] == pytest.approx(3)
    assert doc["inputs"]["inference_ms"] == pytest.approx(800)
    # the busiest minute's 50/60 req/s over the hour's 60 requests spread over 300 s
    assert doc["inputs"]["peak_multiplier"] == pytest.approx((50 / 60) / (60 / 300))
    assert doc["deployed"]["requests_last_hour"] == 12

    assert main([*command[:-1], "--tenants", "30000", "--peak-multiplier", "2", "--inference-ms", "800",
                 "--tasks-per-tenant-per-hour", "3"]) == 0           # every flag wins: the document's figures
    out = capsys.readouterr().out
    assert "tenants 30000 (flag)" in out and "instances, 300 s jitter window:" in out and " 721 " in out
    assert main([*command[:-1]]) == 0
    assert "12 requests in the last 60 min" in capsys.readouterr().out


def test_a_refused_arrival_counts_and_a_repeated_one_does_not(r, settings):
    from dataclasses import replace

    from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue

    keys, tier = Keys(settings.key_prefix), replace(settings.tier("batch"), queue_max_len=1)
    now_s = 1_767_225_600 + 7 * 60                     # minute 7 of an hour
    calls = [EnqueueCall(keys, tier, "default", tenant="t", tag=f"tag{i}", est_tokens=100,
                         message_json="{}", now_s=now_s) for i in range(2)]
    assert enqueue(r, calls[0]).accepted and not enqueue(r, calls[1]).accepted   # the tier is full
    assert not enqueue(r, replace(calls[1], count_demand=False)).accepted        # the same arrival again
    key = keys.demand("default", "batch", now_s // 3600)
    assert r.hgetall(key) == {b"r7": b"2", b"t7": b"200"}


def test_bench_demand_reports_both_variants_side_by_side(redis_url):
    from devtools.bench.demand import TARGET_RATIO, run

    result = run(redis_url, rounds=2, per_round=20)
    t = result["us_per_enqueue"]
    assert t["with_count"]["runs"] == t["without"]["runs"] == 2 and t["without"]["median"] > 0
    assert result["ratio_of_medians"] > 0 and result["target_ratio_at_most"] == TARGET_RATIO
