"""Prometheus metrics read from Redis at scrape time.

Every counter the router, the workers and beat keep lives in Redis (the stats
and bucket hashes of each pool, the queue lists, the in-flight hash), so one
scrape of any API replica -- or one ``gateway metrics`` -- sees the whole
deployment, every worker on every node, without a push gateway.

A scrape costs two Redis round trips: one pipeline for every hash and list (the
demand history's few minutes included), one more for the tiers of the tenants
that have tasks in flight.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway_tasks.core.redis_client import data_client, queue_time
from gateway_tasks.capacity.forecast import Forecast
from gateway_tasks.capacity.history import (LEAD_FROM_MIN, LEAD_TO_MIN, DemandForecast, cells_of, forecasts,
                                            minute_of, parse_reads, plan_reads, same_time_minutes)
from gateway_tasks.dispatch.index_entry import backlog_tokens
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings, get_settings
from gateway_tasks.core.stats import (ACTUAL_TOKENS, CANCELLED, CIRCUIT_CLOSES, CIRCUIT_OPENS, COMPLETED,
                                      DEAD_LETTERED, DEFERRED, DEFERRED_REFUSED, DEFERRED_RELEASED,
                                      DEFERRAL_REASON, DEGRADED, DISPATCHED, EST_TOKENS, EVICTED, EXPIRED,
                                      FAILOVERS, RESCUED, RETRIES, UPSTREAM_429, UPSTREAM_ERRORS, UPSTREAM_MS,
                                      WAIT_MS, tier_field)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UNKNOWN_TIER = "unknown"
#: index entries read per (tier, pool) to estimate the backlog's tokens: exact up to
#: this many queued tasks, a uniform sample (ZRANDMEMBER) scaled to the depth beyond
BACKLOG_SAMPLE = 2000
#: the forecast windows exported, in minutes from now (each one sums the bins it covers)
FORECAST_WINDOWS_MIN = (1, 5, 10)

# per-tier stats counter (gateway_tasks.core.stats) -> (metric name, help)
_TIER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (DISPATCHED, "gateway_dispatched_tasks",
     "Tasks pick.lua dispatched (admitted through the pool bucket), per tier and pool."),
    (EST_TOKENS, "gateway_estimated_tokens",
     "Estimated tokens debited from the pool bucket at dispatch."),
    (ACTUAL_TOKENS, "gateway_actual_tokens",
     "Tokens the upstream reported (prompt + completion) for completed calls."),
    (COMPLETED, "gateway_completed_tasks",
     "Upstream calls that completed with a usage report."),
    (RETRIES, "gateway_retries",
     "Transient upstream failures requeued against the tier's retry budget."),
    (DEAD_LETTERED, "gateway_dead_lettered_messages",
     "Malformed messages taken off a queue and dead-lettered with their reason."),
    (UPSTREAM_MS, "gateway_upstream_call_milliseconds",
     "Upstream call time of the completed calls, summed (mean latency = this / completed)."),
    (EXPIRED, "gateway_expired_tasks",
     "Tasks dropped stale: dispatched past their deadline or their tier's queue TTL, "
     "without calling the upstream."),
    (EVICTED, "gateway_evicted_tasks",
     "Queued tasks evicted to make room for a higher tier's arrival (shared queue capacity full)."),
    (CANCELLED, "gateway_cancelled_tasks",
     "Tasks cancelled by their owner (or a synchronous caller that went away), queued or running."),
    (DEFERRED, "gateway_deferred_tasks",
     "Tasks the load level deferred and held (accepted, released later), per tier and pool."),
    (DEFERRED_RELEASED, "gateway_deferred_released_tasks",
     "Held deferred tasks released onto their queue (their retry time came, or the level fell)."),
    (DEFERRED_REFUSED, "gateway_deferred_refused_tasks",
     "Deferred submits refused (Deferred, 429) because their caller asked for a refusal."),
    (DEGRADED, "gateway_degraded_tasks",
     "Tasks completed with a capped max_tokens or a fallback model (overload), per tier and serving pool."),
)
# pool-wide stats counter -> (metric name, help)
_POOL_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (UPSTREAM_ERRORS, "gateway_upstream_errors", "Upstream 5xx, timeouts and connection errors."),
    (CIRCUIT_OPENS, "gateway_circuit_opens", "Times the pool's circuit breaker opened."),
    (CIRCUIT_CLOSES, "gateway_circuit_closes", "Times a half-open probe closed the circuit (failback)."),
    (RESCUED, "gateway_rescued_tasks",
     "Queued reserved-tier tasks moved to a backup pool while this pool was drained or its circuit open."),
    (FAILOVERS, "gateway_failovers",
     "Reserved-tier calls this pool failed that a backup pool served (at dispatch)."),
)
CIRCUIT_STATES = ("closed", "open", "half_open")


@dataclass
class Snapshot:
    """Everything one scrape reads from Redis, decoded."""

    now_ms: int
    stats: dict[str, dict[str, float]] = field(default_factory=dict)      # pool -> field -> value
    buckets: dict[str, dict[str, float]] = field(default_factory=dict)    # pool -> field -> value
    depth: dict[str, int] = field(default_factory=dict)                   # queue name -> LLEN
    inflight_by_tier: dict[str, int] = field(default_factory=dict)
    tenants: int = 0
    unacked: int = 0
    cron: dict[str, float] = field(default_factory=dict)                  # outcome -> count
    backlog_tokens: dict[tuple[str, str], float] = field(default_factory=dict)  # (tier, pool) ->
    forecast: Forecast | None = None
    overload: dict[str, str] = field(default_factory=dict)                # the load-level state hash
    deferred_held: dict[str, int] = field(default_factory=dict)           # tier -> deferred tasks held
    circuits: dict[str, str] = field(default_factory=dict)                # pool -> circuit state
    demand: list[DemandForecast] = field(default_factory=list)            # per (pool, tier)


def _num_hash(raw: dict[bytes, bytes]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in raw.items():
        try:
            out[k.decode()] = float(v)
        except ValueError:
            continue
    return out


def read_snapshot(client: redis.Redis, settings: Settings) -> Snapshot:
    """Read every metric source in one pipeline (plus one for in-flight tenants' tiers)."""
    keys = Keys(settings.key_prefix)
    pools = [p.name for p in settings.pools]
    # the demand history's minutes, on this host's clock as the enqueues name them
    cells = cells_of(pools, (t.name for t in settings.tiers))
    minutes = same_time_minutes(minute_of(int(time.time() * 1000)))
    demand_reads = plan_reads(keys, cells, minutes)
    with client.pipeline(transaction=False) as pipe:
        queue_time(pipe)
        for pool in pools:
            pipe.hgetall(keys.stats(pool))
            pipe.hgetall(keys.bucket(pool))
            for tier in settings.tiers:
                pipe.zcard(keys.index(pool, tier.name))   # a tier's queue length
            pipe.hgetall(keys.inflight(pool))
            pipe.hlen(keys.dispatched(pool))
            pipe.hget(keys.circuit(pool), "state")
            for tier in settings.tiers:
                pipe.zrandmember(keys.index(pool, tier.name), BACKLOG_SAMPLE)
        pipe.scard(keys.tenants)
        pipe.hgetall(keys.cron_stats)
        pipe.get(keys.cron_forecast)
        pipe.hmget(keys.overload_state, "level", "changes")
        for read in demand_reads:
            pipe.hmget(read.key, read.fields)
        for tier in settings.tiers:
            for pool in pools:
                pipe.zcard(keys.deferred(pool, tier.name))
        replies = pipe.execute()
    sec, usec = replies[0]
    snap = Snapshot(now_ms=int(sec) * 1000 + int(usec) // 1000)
    i = 1
    inflight: dict[str, int] = {}
    for pool in pools:
        snap.stats[pool] = _num_hash(replies[i])
        snap.buckets[pool] = _num_hash(replies[i + 1])
        i += 2
        for tier in settings.tiers:
            snap.depth[settings.queue_name(tier.name, pool)] = int(replies[i])
            i += 1
        for tenant, n in _num_hash(replies[i]).items():
            inflight[tenant] = inflight.get(tenant, 0) + int(n)
        snap.unacked += int(replies[i + 1])
        snap.circuits[pool] = (replies[i + 2] or b"closed").decode()
        i += 3
        for tier in settings.tiers:
            snap.backlog_tokens[(tier.name, pool)] = backlog_tokens(
                replies[i] or [], snap.depth[settings.queue_name(tier.name, pool)])
            i += 1
    snap.tenants = int(replies[i])
    snap.cron = _num_hash(replies[i + 1])
    if replies[i + 2]:
        try:
            snap.forecast = Forecast.from_json(replies[i + 2])
        except (ValueError, KeyError, TypeError):
            snap.forecast = None
    level, changes = replies[i + 3]
    snap.overload = {"level": (level or b"0").decode(), "changes": (changes or b"0").decode()}
    held_at = len(replies) - len(settings.tiers) * len(pools)    # the deferred sets' sizes come last
    snap.demand = forecasts(cells, minutes, parse_reads(demand_reads, replies[i + 4:held_at]), snap.forecast,
                            snap.now_ms)
    sizes = replies[held_at:]
    snap.deferred_held = {t.name: sum(int(n) for n in sizes[k * len(pools):(k + 1) * len(pools)])
                          for k, t in enumerate(settings.tiers)}
    snap.inflight_by_tier = _inflight_by_tier(client, keys, settings, inflight)
    return snap


def _inflight_by_tier(client: redis.Redis, keys: Keys, settings: Settings,
                      inflight: dict[str, int]) -> dict[str, int]:
    out = {t.name: 0 for t in settings.tiers}
    busy = [(tenant, n) for tenant, n in inflight.items() if n > 0]
    if not busy:
        return out
    with client.pipeline(transaction=False) as pipe:
        for tenant, _ in busy:
            pipe.hget(keys.tenant(tenant), "tier")
        tiers = pipe.execute()
    for (_, n), tier in zip(busy, tiers):
        name = tier.decode() if tier else UNKNOWN_TIER
        out[name] = out.get(name, 0) + n
    return out


def families(snap: Snapshot, settings: Settings) -> Iterator[Metric]:
    """The metric families of one snapshot (pure: no I/O)."""
    tiers = [t.name for t in settings.tiers]

    depth = GaugeMetricFamily("gateway_queue_depth_messages",
                              "Tasks waiting in a tier's queue to a pool.",
                              labels=["queue", "tier", "pool"])
    for pool in settings.pools:
        for tier in tiers:
            queue = settings.queue_name(tier, pool.name)
            depth.add_metric([queue, tier, pool.name], snap.depth.get(queue, 0))
    yield depth
    yield from _backlog_families(snap, settings)
    yield from _forecast_families(snap)
    yield from _demand_families(snap)

    for counter, name, help_text in _TIER_COUNTERS:
        fam = CounterMetricFamily(name, help_text, labels=["tier", "pool"])
        for pool, stats in snap.stats.items():
            for tier in tiers:
                fam.add_metric([tier, pool], stats.get(tier_field(counter, tier), 0.0))
        yield fam

    wait_total = CounterMetricFamily("gateway_queue_wait_seconds",
                                     "Total time dispatched tasks waited in their queue.",
                                     labels=["tier", "pool"])
    wait_mean = GaugeMetricFamily("gateway_queue_wait_mean_seconds",
                                  "Mean queue wait since the stats began (total wait / dispatched; "
                                  "0 before the first dispatch).", labels=["tier", "pool"])
    for pool, stats in snap.stats.items():
        for tier in tiers:
            wait_s = stats.get(tier_field(WAIT_MS, tier), 0.0) / 1000.0
            dispatched = stats.get(tier_field(DISPATCHED, tier), 0.0)
            wait_total.add_metric([tier, pool], wait_s)
            wait_mean.add_metric([tier, pool], wait_s / dispatched if dispatched else 0.0)
    yield wait_total
    yield wait_mean

    for counter, name, help_text in _POOL_COUNTERS:
        fam = CounterMetricFamily(name, help_text, labels=["pool"])
        for pool, stats in snap.stats.items():
            fam.add_metric([pool], stats.get(counter, 0.0))
        yield fam
    circuit = GaugeMetricFamily("gateway_circuit_state",
                                "1 for the state each pool's circuit breaker is in.",
                                labels=["pool", "state"])
    for pool, state in snap.circuits.items():
        for name in CIRCUIT_STATES:
            circuit.add_metric([pool, name], 1.0 if state == name else 0.0)
    yield circuit
    yield GaugeMetricFamily("gateway_overload_level",
                            "The deployment's load level in force (0 = L0 normal .. 4 = L4).",
                            value=float(snap.overload.get("level", 0) or 0))
    reasons = CounterMetricFamily("gateway_deferrals_by_reason",
                                  "Deferrals by the table's reason code: held (accepted, run later) or "
                                  "refused (the caller asked for a refusal).",
                                  labels=["tier", "pool", "reason", "outcome"])
    for pool, stats in snap.stats.items():
        for name, value in sorted(stats.items()):
            parts = name.split(":")
            if len(parts) == 4 and parts[0] == DEFERRAL_REASON:
                reasons.add_metric([parts[3], pool, parts[1], parts[2]], value)
    yield reasons
    held = GaugeMetricFamily("gateway_deferred_held_tasks",
                             "Deferred tasks held now (not queued), released at their retry time or "
                             "when the level falls.", labels=["tier"])
    for tier, n in snap.deferred_held.items():
        held.add_metric([tier], float(n))
    yield held
    yield CounterMetricFamily("gateway_overload_level_changes",
                              "Changes of the load level (each one logged and kept in `gateway status`).",
                              value=float(snap.overload.get("changes", 0) or 0))

    http_429 = CounterMetricFamily("gateway_upstream_429_responses",
                                   "Upstream 429 responses (each drains the pool until Retry-After).",
                                   labels=["pool"])
    for pool, stats in snap.stats.items():
        http_429.add_metric([pool], stats.get(UPSTREAM_429, 0.0))
    yield http_429

    yield from _bucket_families(snap, settings)

    inflight = GaugeMetricFamily("gateway_inflight_tasks",
                                 "Tasks dispatched and not yet acknowledged, per tenant tier.",
                                 labels=["tier"])
    for tier, n in sorted(snap.inflight_by_tier.items()):
        inflight.add_metric([tier], n)
    yield inflight

    yield GaugeMetricFamily("gateway_tenants", "Registered tenants.", value=snap.tenants)
    yield GaugeMetricFamily("gateway_unacked_messages",
                            "Messages delivered to workers and not yet acknowledged.",
                            value=snap.unacked)
    cron = CounterMetricFamily("gateway_cron_events",
                               "Tenant cron outcomes counted by beat (fired, quota, misfire, ...).",
                               labels=["outcome"])
    for outcome, n in sorted(snap.cron.items()):
        cron.add_metric([outcome], n)
    yield cron


def _backlog_families(snap: Snapshot, settings: Settings) -> Iterator[Metric]:
    """The scaling signals of each tier's workers: queued requests and their tokens."""
    requests = GaugeMetricFamily("gateway_backlog_requests",
                                 "Requests queued for a tier and pool (reactive scaling signal).",
                                 labels=["tier", "pool"])
    tokens = GaugeMetricFamily("gateway_backlog_tokens",
                               "Estimated tokens of the queued requests (exact up to "
                               f"{BACKLOG_SAMPLE} queued, sampled beyond).", labels=["tier", "pool"])
    for pool in settings.pools:
        for tier in settings.tiers:
            requests.add_metric([tier.name, pool.name],
                                snap.depth.get(settings.queue_name(tier.name, pool.name), 0))
            tokens.add_metric([tier.name, pool.name], snap.backlog_tokens.get((tier.name, pool.name), 0.0))
    yield requests
    yield tokens


def _forecast_families(snap: Snapshot) -> Iterator[Metric]:
    """The leader beat's forecast of cron demand (predictive pre-scaling signal)."""
    tokens = GaugeMetricFamily("gateway_cron_forecast_tokens",
                               "Estimated tokens cron runs will ask a pool for within the next "
                               "window_minutes (from the schedule, jitter included).",
                               labels=["pool", "tier", "window_minutes"])
    runs = GaugeMetricFamily("gateway_cron_forecast_runs",
                             "Cron runs firing within the next window_minutes.",
                             labels=["pool", "tier", "window_minutes"])
    peak = GaugeMetricFamily("gateway_cron_forecast_peak_tokens_per_minute",
                             "The busiest minute of the forecast horizon, in tokens, per pool.",
                             labels=["pool"])
    made = GaugeMetricFamily("gateway_cron_forecast_generated_timestamp_seconds",
                             "When the leader beat computed the forecast (absent: no beat leads).")
    fc = snap.forecast
    if fc is not None:
        elapsed_bins = max(0, (snap.now_ms - fc.start_ms) // (fc.bucket_s * 1000))
        for (pool, tier), series in sorted(fc.series.items()):
            for minutes in FORECAST_WINDOWS_MIN:
                n = -(-minutes * 60 // fc.bucket_s)
                sl = slice(elapsed_bins, elapsed_bins + n)
                tokens.add_metric([pool, tier, str(minutes)], float(sum(series.tokens[sl])))
                runs.add_metric([pool, tier, str(minutes)], float(sum(series.runs[sl])))
        per_minute = 60 / fc.bucket_s
        for pool in sorted({p for p, _ in fc.series}):
            bins = fc.pool_tokens(pool)[elapsed_bins:]
            peak.add_metric([pool], max(bins, default=0) * per_minute)
        made.add_metric([], fc.generated_ms / 1000.0)
    yield from (tokens, runs, peak, made)


def _demand_families(snap: Snapshot) -> Iterator[Metric]:
    """The demand forecast (gateway_tasks.capacity.history): predictive scaling's signal."""
    window = f"{LEAD_FROM_MIN}-{LEAD_TO_MIN} minutes ahead"
    requests = GaugeMetricFamily(
        "gateway_demand_forecast_requests_per_minute",
        f"Requests per minute forecast for a tier and pool {window}: source=history (P95 of the same "
        "time of day over the last 7 days), cron (the schedule's busiest minute), combined (the larger).",
        labels=["pool", "tier", "source"])
    tokens = GaugeMetricFamily(
        "gateway_demand_forecast_tokens_per_minute",
        f"Estimated tokens per minute forecast for a tier and pool {window} (sources as for requests).",
        labels=["pool", "tier", "source"])
    for d in snap.demand:
        for source, r, t in (("history", d.history_requests, d.history_tokens),
                             ("cron", d.cron_requests, d.cron_tokens), ("combined", d.requests, d.tokens)):
            requests.add_metric([d.pool, d.tier, source], r)
            tokens.add_metric([d.pool, d.tier, source], t)
    yield requests
    yield tokens


def _bucket_families(snap: Snapshot, settings: Settings) -> Iterator[Metric]:
    stored_t = GaugeMetricFamily("gateway_bucket_tokens",
                                 "Pool bucket token level as stored, i.e. at "
                                 "gateway_bucket_updated_timestamp_seconds (capacity if never used).",
                                 labels=["pool"])
    stored_r = GaugeMetricFamily("gateway_bucket_requests",
                                 "Pool bucket request level as stored (see gateway_bucket_tokens).",
                                 labels=["pool"])
    updated = GaugeMetricFamily("gateway_bucket_updated_timestamp_seconds",
                                "When the stored bucket levels were computed (Redis clock).",
                                labels=["pool"])
    avail_t = GaugeMetricFamily("gateway_bucket_available_tokens",
                                "Token level refilled to scrape time: what the next dispatch sees.",
                                labels=["pool"])
    avail_r = GaugeMetricFamily("gateway_bucket_available_requests",
                                "Request level refilled to scrape time.", labels=["pool"])
    cap_t = GaugeMetricFamily("gateway_bucket_capacity_tokens",
                              "Pool bucket token capacity (TPM * burst_s / 60).", labels=["pool"])
    cap_r = GaugeMetricFamily("gateway_bucket_capacity_requests",
                              "Pool bucket request capacity (RPM * burst_s / 60).", labels=["pool"])
    blocked = GaugeMetricFamily("gateway_pool_blocked_remaining_seconds",
                                "Seconds the pool stays drained after an upstream 429 (0: open).",
                                labels=["pool"])
    for pool in settings.pools:
        tcap, trate, rcap, rrate = pool.rates()
        b = snap.buckets.get(pool.name, {})
        tokens, requests = b.get("tokens", tcap), b.get("requests", rcap)
        ts_ms = b.get("ts_ms", float(snap.now_ms))
        dt_ms = max(0.0, snap.now_ms - ts_ms)
        stored_t.add_metric([pool.name], tokens)
        stored_r.add_metric([pool.name], requests)
        updated.add_metric([pool.name], ts_ms / 1000.0)
        avail_t.add_metric([pool.name], min(tcap, tokens + dt_ms * trate))
        avail_r.add_metric([pool.name], min(rcap, requests + dt_ms * rrate))
        cap_t.add_metric([pool.name], tcap)
        cap_r.add_metric([pool.name], rcap)
        blocked.add_metric([pool.name], max(0.0, b.get("blocked_until_ms", 0.0) - snap.now_ms) / 1000.0)
    yield from (stored_t, stored_r, updated, avail_t, avail_r, cap_t, cap_r, blocked)


class GatewayCollector(Collector):
    """A prometheus_client collector that reads Redis on every scrape."""

    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings

    def describe(self) -> list[Metric]:
        return []  # no Redis access when registering

    def collect(self) -> Iterator[Metric]:
        yield from families(read_snapshot(self.r, self.settings), self.settings)


def render(gateway_or_client: Any, settings: Settings | None = None) -> bytes:
    """Prometheus text exposition of the deployment; accepts a Gateway or a redis client."""
    client = getattr(gateway_or_client, "r", gateway_or_client)
    settings = settings or getattr(gateway_or_client, "settings", None) or get_settings()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(client, settings))
    return generate_latest(registry)


# -- CLI ----------------------------------------------------------------------
def _print_once(args: argparse.Namespace) -> int:
    settings = get_settings()
    client = data_client(settings, "`gateway metrics`")
    try:   # Redis down: one line and its exit status (gateway_tasks.cli.main)
        text = render(client, settings).decode()
    finally:
        client.close()
    sys.stdout.write(text)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``metrics`` command to the ``gateway`` CLI."""
    parser = subparsers.add_parser(
        "metrics", help="print the Prometheus metrics of the deployment once",
        description="Read queue depths, dispatch/token counters, bucket levels and in-flight "
                    "tasks from Redis and print them in Prometheus text format.")
    parser.set_defaults(func=_print_once)
