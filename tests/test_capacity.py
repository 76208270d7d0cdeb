"""The capacity model (pure, table-tested), measured rates from the Redis counters,
the cron demand forecast (pure fire-time maths, then computed from crons registered
in a real Redis, published by the leader beat and exported as metrics), the backlog
metrics per tier, and the `gateway capacity` commands."""

from __future__ import annotations

import argparse
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_tasks.cli import capacity as cli
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.capacity.model import (Instance, TenantLoad, ceil_instances, instance_qps_from_inference_ms,
                                          instance_rps_from_concurrency, instances_needed, plan, raw_instances,
                                          tenant_baseline_qps, tenant_instances, tenant_peak_qps, tenant_plan)
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.capacity.forecast import Forecast, bin_of, validate_window
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.stats import ACTUAL_TOKENS, COMPLETED, UPSTREAM_MS, tier_field
from gateway_tasks.core.tokens import count_prompt_tokens
from gateway_tasks.dispatch.index_entry import backlog_tokens
from gateway_tasks.metrics.exporter import render
from gateway_tasks.producer.gateway import Gateway

from beat.forecast import ForecastPublisher, compute_forecast, fire_times_ms, read_published
from beat.jitter import jitter_offset_s
from beat.store import CronStore

T0 = 1_767_225_600_000            # 2026-01-01T00:00:00Z
MIN = 60_000


# -- the model, pure ----------------------------------------------------------------
@pytest.mark.parametrize("qps,tpr,inst,safety,expected", [
    (100, 1000, Instance(tokens_per_s=50_000), 1.5, 3),        # 2 raw -> 3
    (100, 1000, Instance(tokens_per_s=100_000), 1.5, 2),       # 1 raw -> 1.5 -> 2
    (10, 500, Instance(requests_per_s=5), 1.5, 3),             # 2 raw -> 3
    (30, 100, Instance(tokens_per_s=1e6, requests_per_s=10), 1.5, 5),   # requests bind: 3 -> 4.5 -> 5
    (30, 10_000, Instance(tokens_per_s=100_000, requests_per_s=100), 1.5, 5),  # tokens bind: 3 -> 5
    (20, 100, Instance(tokens_per_s=1000), 1.5, 3),            # exactly 3.0 (float noise) -> 3
    (0, 1000, Instance(tokens_per_s=1000), 1.5, 0),
    (1, 1, Instance(tokens_per_s=1e9), 1.5, 1),                # any load needs one
    (100, 1000, Instance(tokens_per_s=50_000), 1.0, 2),
])
def test_instances_needed_table(qps, tpr, inst, safety, expected):
    assert instances_needed(qps, tpr, inst, safety) == expected


@pytest.mark.parametrize("raw,expected", [(0, 0), (0.01, 1), (1.0, 1), (1.0000000000000002, 1),
                                          (2.5, 3), (3 * 1.1 / 1.1, 3)])
def test_ceil_instances_ignores_float_noise(raw, expected):
    assert ceil_instances(raw) == expected


@pytest.mark.parametrize("concurrency,latency,rps", [(32, 2.0, 16.0), (16, 0.5, 32.0), (1, 4, 0.25)])
def test_littles_law(concurrency, latency, rps):
    assert instance_rps_from_concurrency(concurrency, latency) == pytest.approx(rps)


def test_plan_baseline_peak_warm_pool_and_upstream_quota():
    p = plan(20, 120, 900, Instance(requests_per_s=16), 1.5, upstream_tpm=600_000)
    assert (p.baseline.instances, p.peak.instances) == (2, 12)        # 1.25 -> 1.875, 7.5 -> 11.25
    assert p.baseline.tokens_per_minute == 20 * 900 * 60
    assert p.peak_over_baseline == 6
    assert (p.warm_pool, p.max_replicas) == (2, 12)
    assert p.upstream_tpm_needed == 120 * 900 * 60 * 1.5 and p.upstream_ok is False
    assert plan(1, 2, 100, Instance(requests_per_s=16), upstream_tpm=1e6).upstream_ok is True
    assert plan(0, 0, 100, Instance(requests_per_s=1)).warm_pool == 1
    assert json.loads(json.dumps(p.as_dict()))["peak"]["instances"] == 12


@pytest.mark.parametrize("call,fragment", [
    (lambda: Instance(), "per-instance throughput"),
    (lambda: Instance(tokens_per_s=0), "tokens_per_s=0"),
    (lambda: Instance(requests_per_s=-1), "requests_per_s=-1"),
    (lambda: raw_instances(float("nan"), 1, Instance(tokens_per_s=1)), "qps=nan"),
    (lambda: instances_needed(1, 1, Instance(tokens_per_s=1), safety_factor=0.9), "safety_factor=0.9"),
    (lambda: plan(10, 5, 1, Instance(tokens_per_s=1)), "below baseline_qps"),
    (lambda: instance_rps_from_concurrency(8, 0), "latency_s=0"),
    (lambda: plan(1, 2, 1, Instance(tokens_per_s=1), upstream_tpm=0), "upstream_tpm=0"),
])
def test_bad_input_is_a_config_error_naming_it(call, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        call()
    assert fragment in str(info.value)


# -- the tenant model, pure ------------------------------------------------------------
@pytest.mark.parametrize("tenants,tasks_per_hour,expected_qps", [
    (30_000, 3, 25.0), (3600, 1, 1.0), (100, 0, 0.0), (1, 0.5, 0.5 / 3600)])
def test_tenant_baseline_qps_table(tenants, tasks_per_hour, expected_qps):
    assert tenant_baseline_qps(tenants, tasks_per_hour) == pytest.approx(expected_qps)


@pytest.mark.parametrize("tenants,tasks_per_hour,window_s,multiplier,expected_qps", [
    (30_000, 3, 1, 2.0, 180_000.0),          # no jitter: every task in the same second
    (30_000, 3, 300, 2.0, 600.0),            # a 5-minute window
    (30_000, 3, 600, 1.0, 150.0),
    (1000, 1, 120, 1.5, 12.5),
])
def test_tenant_peak_qps_table(tenants, tasks_per_hour, window_s, multiplier, expected_qps):
    assert tenant_peak_qps(tenants, tasks_per_hour, window_s, multiplier) == pytest.approx(expected_qps)


@pytest.mark.parametrize("peak_qps,inference_ms,safety,expected", [
    (600, 800, 1.5, 721),                    # 600 / 1.25 x 1.5 = 720.0 -> int + 1
    (180_000, 800, 1.5, 216_001),            # 216000.0 -> 216001
    (10, 1000, 1.0, 11),                     # exactly 10.0 -> 11 (int + 1, not ceil)
    (10, 1050, 1.0, 11),                     # 10.5 -> 11
    (0, 800, 1.5, 1),                        # no load: one instance
    (0.1 * 3, 1000, 1.0, 1),                 # 0.30000000000000004 -> 1
])
def test_tenant_instances_table(peak_qps, inference_ms, safety, expected):
    assert tenant_instances(peak_qps, inference_ms, safety) == expected


def test_instance_qps_from_inference_ms():
    assert instance_qps_from_inference_ms(800) == 1.25
    assert instance_qps_from_inference_ms(2000) == 0.5


DOC_EXAMPLE = TenantLoad(tenants=30_000, tasks_per_tenant_per_hour=3, peak_multiplier=2.0, inference_ms=800,
                         p99_target_ms=3000, safety_factor=1.5, jitter_window_s=300)


def test_tenant_plan_of_the_design_documents_example():
    p = tenant_plan(DOC_EXAMPLE)
    assert (p.baseline_qps, p.peak_qps_no_jitter, p.peak_qps_jittered) == (25, 180_000, 600)
    assert (p.instances_no_jitter, p.instances_jittered) == (216_001, 721)
    assert p.instance_qps == 1.25 and p.inference_within_p99_target
    assert json.loads(json.dumps(p.as_dict()))["instances_jittered"] == 721
    slow = tenant_plan(TenantLoad(10, 1, 1, inference_ms=5000, p99_target_ms=3000))
    assert not slow.inference_within_p99_target


@pytest.mark.parametrize("call,fragment", [
    (lambda: tenant_baseline_qps(0, 3), "tenants=0"),
    (lambda: tenant_baseline_qps(10, -1), "tasks_per_tenant_per_hour=-1"),
    (lambda: tenant_peak_qps(10, 3, 0, 2.0), "jitter_window_s=0"),
    (lambda: tenant_peak_qps(10, 3, 300, float("nan")), "peak_multiplier=nan"),
    (lambda: tenant_instances(10, 0, 1.5), "inference_ms=0"),
    (lambda: tenant_instances(10, 800, 0.5), "safety_factor=0.5"),
    (lambda: tenant_plan(TenantLoad(10, 1, 1, 800, p99_target_ms=0)), "p99_target_ms=0"),
])
def test_bad_tenant_model_input_is_a_config_error_naming_it(call, fragment):
    with pytest.raises(ConfigError) as info:
        call()
    assert fragment in str(info.value)


def test_rates_of_counter_samples():
    c = cli.Counters
    samples = [(0.0, c(100, 100_000, 50_000)), (1.0, c(110, 110_000, 70_000)),
               (2.0, c(140, 140_000, 130_000)), (4.0, c(150, 150_000, 150_000))]
    mean, peak, tpr, lat = cli.rates(samples)
    assert mean == pytest.approx(50 / 4) and peak == pytest.approx(30)
    assert tpr == pytest.approx(1000) and lat == pytest.approx(2.0)
    assert cli.rates([(0.0, c(5, 0, 0)), (2.0, c(5, 0, 0))]) == (0.0, 0.0, None, None)
    with pytest.raises(ConfigError, match="two samples"):
        cli.rates(samples[:1])


# -- measured in Redis ----------------------------------------------------------------
def args_for(**kw):
    base = dict(baseline_qps=None, peak_qps=None, tokens_per_request=None, instance_tps=None,
                instance_rps=None, instance_concurrency=None, latency_s=None, safety_factor=1.5,
                upstream_tpm=None, measure_s=0.0, json=False)
    return argparse.Namespace(**{**base, **kw})


DOC_COMMAND = ["capacity", "--tenants", "30000", "--tasks-per-tenant-per-hour", "3", "--peak-multiplier", "2.0",
               "--inference-ms", "800", "--p99-target-ms", "3000", "--safety-factor", "1.5",
               "--jitter-window-s", "300"]


def test_capacity_command_prints_the_design_documents_five_figures(capsys):
    from gateway_tasks.cli.main import main

    assert main(DOC_COMMAND) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = {line.split(":")[0]: line.split(":")[1].split() for line in lines[1:6]}
    assert figures == {
        "baseline QPS (hourly mean)": ["25", "requests/s"],
        "peak QPS, no jitter (1 s window)": ["180000", "requests/s"],
        "peak QPS, 300 s jitter window": ["600", "requests/s"],
        "instances, no jitter (1 s window)": ["216001", "instances"],
        "instances, 300 s jitter window": ["721", "instances"],
    }
    assert "p99 target 3000 ms: inference 800 ms is within it" in lines[6]
    assert main(DOC_COMMAND + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [doc[k] for k in ("baseline_qps", "peak_qps_no_jitter", "peak_qps_jittered", "instances_no_jitter",
                             "instances_jittered")] == [25, 180_000, 600, 216_001, 721]


@pytest.mark.parametrize("argv,fragment", [
    (["--tenants", "10", "--tasks-per-tenant-per-hour", "1", "--peak-multiplier", "2", "--inference-ms", "800"],
     "--p99-target-ms is required"),
    (["--tenants", "10", "--tasks-per-tenant-per-hour", "1", "--peak-multiplier", "2", "--p99-target-ms", "1"],
     "--inference-ms is required"),
    (["--jitter-window-s", "300", "--baseline-qps", "1"], "give --tenants too"),
    (["--tenants", "10", "--baseline-qps", "1"], "--baseline-qps belong to the QPS model"),
])
def test_tenant_model_flags_missing_or_mixed_name_the_flag(argv, fragment, capsys):
    from gateway_tasks.cli.main import main
    from gateway_tasks.core.errors import EXIT_CONFIG

    assert main(["capacity", *argv]) == EXIT_CONFIG
    assert fragment in capsys.readouterr().err


def test_tenant_model_takes_the_inference_time_from_a_measurement():
    tenant_flags = dict(tenants=30_000.0, tasks_per_tenant_per_hour=3.0, peak_multiplier=2.0, inference_ms=None,
                        p99_target_ms=3000.0, jitter_window_s=None)
    m = cli.Measured(window_s=30, baseline_qps=8, peak_qps=9, tokens_per_request=500, latency_s=0.8,
                     workers=1, concurrency=4)
    args = args_for(**tenant_flags)
    assert cli.tenant_mode(args)
    load = cli.tenant_load_from_args(args, m)
    assert load.inference_ms == pytest.approx(800) and load.jitter_window_s == 300
    assert tenant_plan(load).instances_jittered == 721
    assert "(measured mean upstream latency)" in cli.format_tenant_plan(tenant_plan(load), m)
    given = cli.tenant_load_from_args(args_for(**{**tenant_flags, "inference_ms": 400.0}), m)
    assert given.inference_ms == 400                                # a flag wins over the measurement


def test_measure_reads_the_pool_counters_and_flags_override(r, settings):
    keys = Keys(settings.key_prefix)
    stats = keys.stats(settings.pools[0].name)
    now = [0.0]

    def sleep(seconds):   # each second: 8 more calls of 500 tokens and 250 ms upstream time each
        now[0] += 1.0
        r.hincrby(stats, tier_field(COMPLETED, "vip"), 8)
        r.hincrby(stats, tier_field(ACTUAL_TOKENS, "vip"), 4000)
        r.hincrby(stats, tier_field(UPSTREAM_MS, "vip"), 2000)

    m = cli.measure(r, settings, 3.0, sleep=sleep, clock=lambda: now[0])
    assert m.baseline_qps == pytest.approx(8.0) and m.peak_qps == pytest.approx(8.0)
    assert m.tokens_per_request == pytest.approx(500) and m.latency_s == pytest.approx(0.25)
    assert m.workers == 0 and m.concurrency is None               # no worker answers here
    with pytest.raises(ConfigError, match="per-instance throughput"):
        cli.plan_from_args(args_for(), settings, m)
    p = cli.plan_from_args(args_for(instance_concurrency=4, peak_qps=40), settings, m)
    assert p.instance.requests_per_s == pytest.approx(16)          # 4 threads / 0.25 s
    assert (p.baseline.qps, p.peak.qps, p.tokens_per_request) == (8.0, 40, 500)
    assert (p.baseline.instances, p.peak.instances) == (1, 4)     # 0.75, 3.75
    assert p.upstream_tpm_available == sum(pool.tpm for pool in settings.pools)
    assert "8.00 req/s mean" in cli.format_plan(p, m)


def test_plan_without_measurement_names_the_missing_flag(settings):
    with pytest.raises(ConfigError, match="--baseline-qps is required"):
        cli.plan_from_args(args_for(instance_tps=1000), settings)


# -- forecast, pure --------------------------------------------------------------------
@pytest.mark.parametrize("cron,offset,pending,end,expected", [
    ("0 * * * *", 0, T0, T0 + 10 * MIN, [T0]),
    ("0 * * * *", 420, T0, T0 + 10 * MIN, [T0 + 7 * MIN]),
    ("0 * * * *", 420, T0, T0 + 7 * MIN, []),                   # the end is exclusive
    ("*/5 * * * *", 30, T0, T0 + 12 * MIN, [T0 + 30_000, T0 + 5 * MIN + 30_000, T0 + 10 * MIN + 30_000]),
    # overdue: one catch-up run now, missed ones skipped, then the next after the start
    ("* * * * *", 0, T0 - 2 * MIN, T0 + 3 * MIN, [T0 - 2 * MIN, T0 + MIN, T0 + 2 * MIN]),
    ("0 * * * *", 0, T0 - 30 * 86_400_000, T0 + 2 * 3_600_000, [T0 - 30 * 86_400_000, T0 + 3_600_000]),
])
def test_fire_times_include_jitter_and_repeat_within_the_horizon(cron, offset, pending, end, expected):
    assert list(fire_times_ms(cron, offset, pending, T0, end)) == expected


@pytest.mark.parametrize("fire,expected", [(T0 - 5_000, 0), (T0, 0), (T0 + 59_999, 0), (T0 + MIN, 1),
                                           (T0 + 9 * MIN + 1, 9)])
def test_bin_of(fire, expected):
    assert bin_of(fire, T0, 60) == expected


@pytest.mark.parametrize("horizon,bucket", [(0, 60), (90, 60), (600, 0), (30, 60)])
def test_bad_forecast_window(horizon, bucket):
    with pytest.raises(ConfigError):
        validate_window(horizon, bucket)


# -- forecast from Redis ----------------------------------------------------------------
PROMPT = [{"role": "user", "content": "Summarise the news of the day"}]


@pytest.fixture
def crons(r, settings):
    gw = Gateway(settings)
    for i in range(20):
        gw.register_tenant(f"pro{i}", "normal")
        gw.register_tenant(f"free{i}", "batch")
    gw.register_tenant("big", "vip")
    store = CronStore(r, settings)
    now = T0 - 30_000                                   # 30 s before the hour
    for i in range(20):
        store.add(f"pro{i}", "digest", "0 * * * *", {"messages": PROMPT, "max_tokens": 100}, now=now)
        store.add(f"free{i}", "digest", "0 * * * *", {"messages": PROMPT, "max_tokens": 100}, now=now)
    store.add("big", "tick", "*/2 * * * *", {"messages": PROMPT, "max_tokens": 50}, now=now)
    store.add("big", "later", "0 3 * * *", {"messages": PROMPT}, now=now)     # beyond the horizon
    yield now
    gw.app.close()
    gw.r.close()


def test_forecast_spreads_each_tier_by_its_jitter_and_counts_tokens(r, settings, crons):
    fc = compute_forecast(r, settings, T0, horizon_s=600, bucket_s=60)
    pool = settings.pools[0].name
    est = count_prompt_tokens(PROMPT) + 100
    pro, free, vip = fc.series[(pool, "normal")], fc.series[(pool, "batch")], fc.series[(pool, "vip")]
    assert sum(pro.runs) == 20 and sum(pro.tokens) == 20 * est
    expected_pro = [0] * 10
    expected_free = [0] * 10
    for i in range(20):
        expected_pro[jitter_offset_s(f"pro{i}", "digest", 120) // 60] += 1
        free_bin = jitter_offset_s(f"free{i}", "digest", 600) // 60
        expected_free[free_bin] += 1
    assert pro.runs == expected_pro and pro.runs[2:] == [0] * 8        # 120 s window: first 2 minutes
    assert free.runs == expected_free
    assert vip.runs == [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]                  # every 2 minutes, no jitter
    assert vip.tokens[0] == count_prompt_tokens(PROMPT) + 50
    assert fc.entries_read == 41                                        # "later" is not read
    assert fc.pool_tokens(pool)[0] == pro.tokens[0] + free.tokens[0] + vip.tokens[0]
    assert Forecast.from_json(fc.to_json()).series == fc.series


def test_publisher_exports_forecast_and_backlog_metrics(r, settings, crons):
    pub = ForecastPublisher(r, settings, interval_s=15)
    now = redis_now_ms(r)                 # the exporter reads the forecast against Redis time
    assert pub.maybe_publish(now - 50_000) is not None
    assert pub.maybe_publish(now - 45_000) is None                     # within the interval
    assert pub.maybe_publish(now - 30_000, busy=True) is None          # a storm's fires first
    assert pub.maybe_publish(now, busy=True) is not None               # ... but not for ever
    published = read_published(r, settings)
    assert published is not None and published.start_ms == now
    assert sum(sum(s.runs) for s in published.series.values()) >= 42   # every (overdue) cron once
    assert 0 < r.pttl(Keys(settings.key_prefix).cron_forecast) <= 60_000

    gw = Gateway(settings)
    try:
        for _ in range(3):
            gw.submit("pro0", PROMPT, max_tokens=100)
    finally:
        gw.app.close()
    got = {}
    for fam in text_string_to_metric_families(render(r, settings).decode()):
        for s in fam.samples:
            got[(s.name, frozenset(s.labels.items()))] = s.value
    pool = settings.pools[0].name
    est = count_prompt_tokens(PROMPT) + 100
    assert got[("gateway_backlog_requests", frozenset({"tier": "normal", "pool": pool}.items()))] == 3
    assert got[("gateway_backlog_tokens", frozenset({"tier": "normal", "pool": pool}.items()))] == 3 * est
    assert got[("gateway_backlog_tokens", frozenset({"tier": "vip", "pool": pool}.items()))] == 0
    fc = published
    ten = {(t, w): got[("gateway_cron_forecast_tokens",
                        frozenset({"pool": pool, "tier": t, "window_minutes": w}.items()))]
           for t in ("normal", "batch") for w in ("1", "5", "10")}
    assert ten[("batch", "10")] == sum(fc.series[(pool, "batch")].tokens)
    assert ten[("normal", "1")] == fc.series[(pool, "normal")].tokens[0]
    assert ten[("batch", "5")] == sum(fc.series[(pool, "batch")].tokens[:5])
    assert got[("gateway_cron_forecast_peak_tokens_per_minute", frozenset({"pool": pool}.items()))] == \
        max(fc.pool_tokens(pool))
    assert got[("gateway_cron_forecast_generated_timestamp_seconds", frozenset())] == now / 1000


@pytest.mark.parametrize("depth,sample,expected", [(0, [], 0.0), (3, [b"t|1|a|10|5|1", b"t|2|b|20|5|1",
                                                                       b"t|3|c|30|5|1"], 60.0),
                                                   (300, [b"t|1|a|10|5|1", b"t|2|b|30|5|1"], 6000.0),
                                                   (2, [b"garbage", b"t|2|b|30|5|1"], 60.0)])
def test_backlog_tokens_exact_or_scaled_from_a_sample(depth, sample, expected):
    assert backlog_tokens(sample, depth) == expected


def test_forecast_command_prints_bins_and_json(r, settings, crons, monkeypatch, capsys, redis_url,
                                               key_prefix):
    monkeypatch.delenv("GATEWAY_CONFIG", raising=False)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("GATEWAY_KEY_PREFIX", key_prefix)
    from gateway_tasks.cli.main import main
    from gateway_tasks.core.errors import EXIT_CONFIG
    assert main(["capacity", "forecast", "--horizon-s", "86400", "--bucket-s", "3600", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["bucket_s"] == 3600 and doc["buckets"] == 24
    runs = {(s["pool"], s["tier"]): sum(s["runs"]) for s in doc["series"]}
    assert runs[(settings.pools[0].name, "batch")] >= 20
    assert main(["capacity", "forecast", "--horizon-s", "86400", "--bucket-s", "3600"]) == 0
    text = capsys.readouterr().out
    assert "cron demand from" in text and "batch" in text and "+3600s" in text
    assert main(["capacity", "forecast", "--published"]) == EXIT_CONFIG   # no beat has published (a ConfigError)
    assert "no published forecast" in capsys.readouterr().err
    assert main(["capacity", "--baseline-qps", "1", "--peak-qps", "3", "--tokens-per-request", "10",
                 "--instance-rps", "1"]) == 0
    assert "warm pool (min replicas) 2, max replicas 5" in capsys.readouterr().out


def test_upstream_time_is_flushed_in_batches(r, settings, monkeypatch):
    from gateway_tasks.upstream import stats as upstream_stats

    keys = Keys(settings.key_prefix)
    tally = upstream_stats.UpstreamTimeTally()
    field = tier_field(UPSTREAM_MS, "vip")
    for _ in range(upstream_stats.FLUSH_EVERY - 1):
        tally.add(r, keys, "default", "vip", 10.4)
    assert r.hget(keys.stats("default"), field) is None            # not yet: no round trip per call
    tally.add(r, keys, "default", "vip", 10.4)
    assert int(r.hget(keys.stats("default"), field)) == round(10.4 * upstream_stats.FLUSH_EVERY)
    monkeypatch.setattr(upstream_stats, "FLUSH_AFTER_S", 0.0)        # ... or once the interval passed
    tally.add(r, keys, "default", "batch", 7.0)
    assert int(r.hget(keys.stats("default"), tier_field(UPSTREAM_MS, "batch"))) == 7


@pytest.mark.slow
def test_measured_plan_on_a_running_deployment(r, settings, tmp_path, monkeypatch, redis_url, key_prefix,
                                              capsys):
    """A real worker under load: the measured rates, tokens per call, upstream latency and
    thread count come out of Redis and Celery, and the plan is made from them."""
    import threading
    import time

    from gateway_tasks.core.settings import Pool
    from devtools import processes
    from gateway_tasks.simulator import SimConfig, SimulatorThread

    with SimulatorThread(SimConfig(base_latency_ms=100, ms_per_output_token=0)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",),
                    tpm=600_000, rpm=6_000)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s)
        gw.register_tenant("acme", "vip")
        worker = processes.worker(s, concurrency=6, log_path=str(tmp_path / "w.log")).start()
        stop = threading.Event()

        def load():
            while not stop.is_set():
                gw.submit("acme", "measure me", max_tokens=20)
                time.sleep(0.05)

        feeder = threading.Thread(target=load, daemon=True)
        try:
            processes.wait_for_workers(gw.app, 1)
            feeder.start()
            time.sleep(2.0)
            m = cli.measure(r, s, 4.0)
        finally:
            stop.set()
            feeder.join(timeout=5)
            worker.stop()
            gw.app.close()
    assert m.workers == 1 and m.concurrency == 6
    assert 5 <= m.baseline_qps <= 40 and m.peak_qps >= m.baseline_qps
    assert m.tokens_per_request == pytest.approx(count_prompt_tokens([{"role": "user", "content": "measure me"}])
                                                 + 12, abs=1)              # 60 % of 20 completion tokens
    assert 0.09 <= m.latency_s <= 2.0                                     # 100 ms upstream + the box
    p = cli.plan_from_args(args_for(), s, m)
    assert p.instance.requests_per_s == pytest.approx(6 / m.latency_s)
    assert p.peak.instances >= p.baseline.instances >= 1


def test_the_manual_shows_the_tenant_models_command_and_its_output(capsys):
    import re
    import shlex
    from pathlib import Path

    from gateway_tasks.cli.main import main

    page = (Path(__file__).resolve().parent.parent / "docs" / "scaling.md").read_text()
    found = re.search(r"```sh\n(gateway capacity --tenants [^\n]*)\n```\n\n```text\n(.*?)```", page, re.S)
    assert found, "docs/scaling.md's tenant model example is missing"
    argv = shlex.split(found.group(1))[1:]
    assert argv == DOC_COMMAND
    assert main(argv) == 0
    assert capsys.readouterr().out == found.group(2)
