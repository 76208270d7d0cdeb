"""gateway_tasks.metrics.exporter: known values written into the Redis hashes and lists
come out of the Prometheus text exposition."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_tasks.metrics import exporter as metrics
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.keys import Keys
from gateway_tasks.metrics.exporter import render
from gateway_tasks.core.settings import Pool
from gateway_tasks.tenants.registry import TenantRegistry


def samples(text: bytes | str) -> dict[tuple[str, frozenset], float]:
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: dict, name: str, **labels: str) -> float:
    return got[(name, frozenset(labels.items()))]



def test_stats_bucket_queues_and_inflight(r, settings):
    keys = Keys(settings.key_prefix)
    pool = settings.pools[0]
    r.hset(keys.stats(pool.name), mapping={
        "dispatched:vip": 4, "est_tokens:vip": 400, "wait_ms:vip": 2_000, "actual_tokens:vip": 350,
        "completed:vip": 3, "retries:vip": 1, "dispatched:batch": 1, "wait_ms:batch": 90_000,
        "upstream_429": 2})
    now = redis_now_ms(r)
    r.hset(keys.bucket(pool.name), mapping={"tokens": 1234.5, "requests": 7, "ts_ms": now - 1_000,
                                            "blocked_until_ms": now + 5_000})
    for tier, n in (("vip", 3), ("batch", 1)):   # a tier's queue length is its index's size
        r.zadd(keys.index(pool.name, tier), {f"t|{i:016x}|tag{i}|1|0|1": 0 for i in range(n)})
    tenants = TenantRegistry(r, settings)
    tenants.register("acme", "vip")
    tenants.register("bigco", "enterprise")
    tenants.register("tiny", "batch")
    r.hset(keys.inflight(pool.name), mapping={"acme": 2, "bigco": 3, "tiny": 1, "gone": 4, "idle": 0})
    r.hset(keys.cron_stats, mapping={"fired": 9, "quota": 1})

    got = samples(render(r, settings))
    p = {"pool": pool.name}
    assert value(got, "gateway_queue_depth_messages", queue="gt.vip.default", tier="vip", **p) == 3
    assert value(got, "gateway_queue_depth_messages", queue="gt.batch.default", tier="batch", **p) == 1
    assert value(got, "gateway_queue_depth_messages", queue="gt.normal.default", tier="normal", **p) == 0
    assert value(got, "gateway_dispatched_tasks_total", tier="vip", **p) == 4
    assert value(got, "gateway_dispatched_tasks_total", tier="normal", **p) == 0
    assert value(got, "gateway_estimated_tokens_total", tier="vip", **p) == 400
    assert value(got, "gateway_actual_tokens_total", tier="vip", **p) == 350
    assert value(got, "gateway_completed_tasks_total", tier="vip", **p) == 3
    assert value(got, "gateway_retries_total", tier="vip", **p) == 1
    assert value(got, "gateway_queue_wait_seconds_total", tier="vip", **p) == 2.0
    assert value(got, "gateway_queue_wait_mean_seconds", tier="vip", **p) == 0.5
    assert value(got, "gateway_queue_wait_mean_seconds", tier="batch", **p) == 90.0
    assert value(got, "gateway_queue_wait_mean_seconds", tier="normal", **p) == 0.0
    assert value(got, "gateway_upstream_429_responses_total", **p) == 2

    assert value(got, "gateway_bucket_tokens", **p) == 1234.5
    assert value(got, "gateway_bucket_requests", **p) == 7
    assert value(got, "gateway_bucket_updated_timestamp_seconds", **p) == (now - 1_000) / 1000
    refill = 1_000 * pool.tpm / 60_000  # at least one second of refill since ts_ms
    assert 1234.5 + refill <= value(got, "gateway_bucket_available_tokens", **p) <= 1234.5 + 2 * refill
    assert value(got, "gateway_bucket_available_requests", **p) >= 7 + pool.rpm / 60
    assert value(got, "gateway_bucket_capacity_tokens", **p) == pool.token_capacity
    assert value(got, "gateway_bucket_capacity_requests", **p) == pool.request_capacity
    assert 4.0 < value(got, "gateway_pool_blocked_remaining_seconds", **p) <= 5.0

    assert value(got, "gateway_inflight_tasks", tier="vip") == 5  # acme + bigco (enterprise = vip)
    assert value(got, "gateway_inflight_tasks", tier="batch") == 1
    assert value(got, "gateway_inflight_tasks", tier="normal") == 0
    assert value(got, "gateway_inflight_tasks", tier="unknown") == 4  # tenant since deleted
    assert value(got, "gateway_tenants") == 3
    assert value(got, "gateway_unacked_messages") == 0
    assert value(got, "gateway_cron_events_total", outcome="fired") == 9


def test_fresh_deployment_reports_zeros_and_full_buckets(r, settings):
    got = samples(render(r, settings))
    pool = settings.pools[0]
    assert value(got, "gateway_bucket_tokens", pool=pool.name) == pool.token_capacity
    assert value(got, "gateway_bucket_available_requests", pool=pool.name) == pool.request_capacity
    assert value(got, "gateway_pool_blocked_remaining_seconds", pool=pool.name) == 0
    assert value(got, "gateway_tenants") == 0
    for tier in settings.tiers:
        assert value(got, "gateway_dispatched_tasks_total", tier=tier.name, pool=pool.name) == 0
        assert value(got, "gateway_inflight_tasks", tier=tier.name) == 0
    names = {name for name, _ in got}
    assert all(n.startswith("gateway_") for n in names)


def test_every_pool_is_reported(r, settings):
    second = Pool("eu", base_url="http://127.0.0.1:1/v1", api_key="x",
                                         models=("m-eu",), tpm=60_000, rpm=60)
    s = settings.with_(pools=(settings.pools[0], second))
    r.hset(Keys(s.key_prefix).stats("eu"), "dispatched:normal", 5)
    got = samples(render(r, s))
    assert value(got, "gateway_dispatched_tasks_total", tier="normal", pool="eu") == 5
    assert value(got, "gateway_dispatched_tasks_total", tier="normal", pool="default") == 0
    assert value(got, "gateway_bucket_capacity_tokens", pool="eu") == 60_000


def test_metrics_cli_prints_once(r, settings, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "get_settings", lambda: settings)
    parser = argparse.ArgumentParser(prog="gateway")
    metrics.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["metrics"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "# TYPE gateway_queue_depth_messages gauge" in out
    assert value(samples(out), "gateway_tenants") == 0


def test_cli_needs_redis_url(settings, monkeypatch):
    from gateway_tasks.core.errors import ConfigError
    monkeypatch.setattr(metrics, "get_settings", lambda: settings.with_(redis_url=""))
    with pytest.raises(ConfigError, match="REDIS_URL"):
        metrics._print_once(argparse.Namespace())


def test_lifecycle_counters_are_exported(r, settings):
    """expired (stale-drop), evicted and cancelled are exported per tier and pool."""
    from gateway_tasks.core.keys import Keys
    from gateway_tasks.core.stats import CANCELLED, EVICTED, EXPIRED, tier_field
    from gateway_tasks.metrics.exporter import families, read_snapshot

    stats = Keys(settings.key_prefix).stats("default")
    r.hset(stats, mapping={tier_field(EXPIRED, "vip"): 3, tier_field(EVICTED, "batch"): 2,
                           tier_field(CANCELLED, "normal"): 1})
    found = {(m.name, s.labels["tier"]): s.value for m in families(read_snapshot(r, settings), settings)
             for s in m.samples if s.labels.get("pool") == "default" and "tier" in s.labels}
    assert found[("gateway_expired_tasks", "vip")] == 3
    assert found[("gateway_evicted_tasks", "batch")] == 2
    assert found[("gateway_cancelled_tasks", "normal")] == 1
