"""Benchmark: 100k tenant crons at ``0 * * * *`` across the hour boundary.

    gateway-dev cron-bench [--entries 100000] [--json]      (or: python -m devtools.bench.beat)

For jitter off (every tier window 0) and jitter on (the configured windows),
under a throwaway key prefix:

1. register tenants (enterprise/pro/free = 10/30/60 % of the entries, random
   ids, CRONS_PER_TENANT crons each) and bulk-load the entries (pipelines);
2. run the scheduler's real path -- ``CronEngine.tick``: lock renewal,
   ZRANGEBYSCORE ... LIMIT, planning, ``cron_fire.lua``, the fire function,
   ``cron_record.lua`` -- against Redis while a virtual clock steps one
   second at a time across [boundary - 5 s, boundary + largest window + 5 s];
   the fire function only counts;
3. report the per-second fire histogram (peak, mean and peak/mean within the
   window, overall and per tier), per-tick processing time, a replayed
   dispatch lag, and memory per entry.

"Within the window": overall, the seconds [boundary, boundary + W) with W the
largest configured jitter window (600 s), the same span for both modes so the
two are comparable; per tier, that tier's own window (1 s for a 0 s window).
The enterprise tier has no jitter by design (its runs are on time), so the
boundary second always carries all enterprise runs: the overall peak/mean
cannot meet 1.25 with jitter on, and the figure that says whether jitter
spreads load is the per-tier one.  Because offsets come from a hash they are
as uneven as uniform random draws; ``ideal_uniform_peak_over_mean`` is what
perfectly uniform random offsets give for the same counts (Monte Carlo), so
the hash can be judged against it.

Dispatch lag cannot be measured over a real hour, so it is replayed: tick k
starts at max(its virtual second, the end of tick k-1) and each run's lag is
(its tick's start + the time its fire call returned) - its scheduled time.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import replace
from typing import Any

import redis

from gateway_tasks.core.settings import Settings, load_settings
from devtools.quotas import for_load
from gateway_tasks.tenants.registry import TenantRegistry
from devtools.bench.wall_time import Stopwatch, took_line
from devtools.measure import percentile
from devtools.run_redis import delete_prefix, redis_or_embedded, shown_redis

from beat.engine import CronEngine
from beat.schedule import cron_period_s, iso_utc, validate_cron
from beat.store import CronSpec, CronStore

TIER_MIX = (("enterprise", 0.10), ("pro", 0.30), ("free", 0.60))
CRONS_PER_TENANT = 20
DEFAULT_CRON = "0 * * * *"
PAYLOAD = {"messages": [{"role": "user", "content": "Hourly report, please."}]}
MARGIN_S = 5
TARGET_PEAK_OVER_MEAN = 1.25
IDEAL_TRIALS = 5


def window_stats(counts: dict[int, int], window_s: int) -> dict[str, Any]:
    """Peak and mean fires per second over seconds [0, max(1, window_s))."""
    span = max(1, window_s)
    inside = [counts.get(s, 0) for s in range(span)]
    total = sum(inside)
    mean = total / span
    peak = max(inside) if inside else 0
    return {"window_s": window_s, "fired_in_window": total, "peak_per_s": peak,
            "mean_per_s": round(mean, 2),
            "peak_over_mean": round(peak / mean, 3) if mean else None}


def bucketed_peak_over_mean(counts: dict[int, int], window_s: int, bucket_s: int) -> float | None:
    if window_s < 2 * bucket_s:
        return None
    buckets = [sum(counts.get(s, 0) for s in range(b, b + bucket_s))
               for b in range(0, window_s - window_s % bucket_s, bucket_s)]
    mean = sum(buckets) / len(buckets)
    return round(max(buckets) / mean, 3) if mean else None


def ideal_uniform_peak_over_mean(n: int, window_s: int, rng: random.Random,
                                 trials: int = IDEAL_TRIALS) -> float | None:
    """Mean peak/mean of ``n`` uniformly random offsets in ``window_s`` one-second bins."""
    if window_s <= 1 or n == 0:
        return None
    ratios = []
    for _ in range(trials):
        bins = [0] * window_s
        for _ in range(n):
            bins[rng.randrange(window_s)] += 1
        ratios.append(max(bins) / (n / window_s))
    return round(sum(ratios) / len(ratios), 3)


def tenant_plan(entries: int, crons_per_tenant: int, rng: random.Random) -> list[tuple[str, str, int]]:
    """(tenant id, tier alias, number of crons) covering ``entries`` crons."""
    plan = []
    assigned = 0
    for i, (tier, share) in enumerate(TIER_MIX):
        n = entries - assigned if i == len(TIER_MIX) - 1 else int(round(entries * share))
        assigned += n
        while n > 0:
            k = min(crons_per_tenant, n)
            plan.append((f"t{rng.getrandbits(48):012x}", tier, k))
            n -= k
    return plan


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _memory(client: redis.Redis, settings: Settings, store: CronStore, plan, rng: random.Random,
            delta_bytes: int, entries: int) -> dict[str, Any]:
    keys = store.keys
    ids = [f"{t}:cron-{j}" for t, _, k in rng.sample(plan, min(20, len(plan))) for j in range(k)]
    ids = rng.sample(ids, min(200, len(ids)))
    hashes = [client.memory_usage(keys.cron(eid), samples=0) or 0 for eid in ids]
    payloads = [client.memory_usage(keys.cron_payload(eid), samples=0) or 0 for eid in ids]
    zset = client.memory_usage(keys.cron_due, samples=0) or 0
    sets = [(client.memory_usage(keys.cron_tenant(t), samples=0) or 0) / k
            for t, _, k in rng.sample(plan, min(50, len(plan)))]
    return {
        "used_memory_delta_per_entry_b": round(delta_bytes / entries, 1),
        "hash_memory_usage_mean_b": round(sum(hashes) / len(hashes), 1),
        "payload_memory_usage_mean_b": round(sum(payloads) / len(payloads), 1),
        "zset_memory_usage_per_entry_b": round(zset / entries, 1),
        "tenant_set_memory_usage_per_entry_b": round(sum(sets) / len(sets), 1),
    }


def run_mode(client: redis.Redis, base: Settings, plan, cron: str, jitter: bool, boundary_s: int,
             batch_size: int, seed: int) -> dict[str, Any]:
    prefix = f"gt-bench-{uuid.uuid4().hex[:10]}:"
    tiers = base.tiers if jitter else tuple(replace(t, jitter_window_s=0) for t in base.tiers)
    settings = for_load(base.with_(key_prefix=prefix, tiers=tiers))
    rng = random.Random(seed)
    boundary_ms = boundary_s * 1000
    window_s = max(t.jitter_window_s for t in base.tiers)
    period_s = cron_period_s(cron)
    try:
        started = time.perf_counter()
        registry = TenantRegistry(client, settings)
        for tenant, tier, _ in plan:
            registry.register(tenant, tier, api_key=f"bench-{tenant}")
        tenants_s = time.perf_counter() - started

        store = CronStore(client, settings)
        entries = sum(k for _, _, k in plan)
        mem0 = used_memory(client)
        started = time.perf_counter()
        store.add_many((CronSpec(t, f"cron-{j}", cron, PAYLOAD) for t, _, k in plan for j in range(k)),
                       now=boundary_ms - 10_000)
        load_s = time.perf_counter() - started
        mem1 = used_memory(client)
        memory = _memory(client, settings, store, plan, rng, mem1 - mem0, entries)

        clock_ms = [boundary_ms - MARGIN_S * 1000]
        engine = CronEngine(client, settings, fire=lambda entry, nominal: "bench",
                            clock=lambda: clock_ms[0] / 1000.0, tick_interval_s=30.0,
                            batch_size=batch_size)
        if not engine.lock.acquire():
            raise RuntimeError("bench: could not take the beat lock of a fresh prefix")
        per_tier: dict[str, Counter] = defaultdict(Counter)
        overall: Counter = Counter()
        statuses: Counter = Counter()
        ticks: list[tuple[int, float, int, list]] = []   # (now_ms, duration_s, due_seen, fired)
        run_started = time.perf_counter()
        for second in range(-MARGIN_S, window_s + MARGIN_S + 1):
            now = boundary_ms + second * 1000
            clock_ms[0] = now
            while True:
                t0 = time.perf_counter()
                report = engine.tick(now_ms=now)
                ticks.append((now, time.perf_counter() - t0, report.due_seen, report.fired))
                statuses.update(report.statuses)
                for run in report.fired:
                    overall[second] += 1
                    per_tier[run.tier][second] += 1
                if not report.more_due:
                    break
        run_s = time.perf_counter() - run_started
        mem2 = used_memory(client)
        fired_total = sum(overall.values())
        engine.close()
    finally:
        delete_prefix(client, prefix, batch=5000)

    busy = [d * 1000 for _, d, due, _ in ticks if due]
    empty = [d * 1000 for _, d, due, _ in ticks if not due]
    largest = max(ticks, key=lambda t: t[2])
    lags: list[float] = []
    tier_lags: dict[str, list[float]] = defaultdict(list)
    end_ms = float("-inf")
    for now, duration, _, fired in ticks:
        start_ms = max(float(now), end_ms)
        end_ms = start_ms + duration * 1000
        for run in fired:
            lag = start_ms + run.done_s * 1000 - run.scheduled_ms
            lags.append(lag)
            tier_lags[run.tier].append(lag)

    tier_rows = {}
    ideal_rng = random.Random(seed + 1)
    for tier in settings.tiers:
        counts = per_tier.get(tier.name, Counter())
        w = min(tier.jitter_window_s, period_s)
        row = window_stats(counts, w)
        row["alias"] = ",".join(tier.aliases)
        row["fired"] = sum(counts.values())
        row["peak_over_mean_10s_buckets"] = bucketed_peak_over_mean(counts, w, 10)
        row["ideal_uniform_peak_over_mean"] = ideal_uniform_peak_over_mean(row["fired"], w, ideal_rng)
        row["dispatch_lag_p99_ms"] = round(
            percentile(tier_lags.get(tier.name, []), 99, default=0.0), 1)
        tier_rows[tier.name] = row
    jittered = Counter()
    for tier in settings.tiers:
        if min(tier.jitter_window_s, period_s) > 0:
            jittered.update(per_tier.get(tier.name, Counter()))
    overall_row = window_stats(overall, window_s)
    peak_second = max(overall, key=lambda s: (overall[s], -s)) if overall else None
    return {
        "jitter": jitter,
        "fired": fired_total,
        "statuses": dict(statuses),
        "overall": {**overall_row, "peak_second": peak_second},
        "jittered_tiers_only": window_stats(jittered, window_s) if jittered else None,
        "tiers": tier_rows,
        "histogram_per_s": {str(s): overall.get(s, 0)
                            for s in range(-MARGIN_S, window_s + MARGIN_S + 1)},
        "ticks": {
            "count": len(ticks),
            "busy_ticks": len(busy),
            "busy_tick_ms_p50": round(percentile(busy, 50, default=0.0), 2),
            "busy_tick_ms_p99": round(percentile(busy, 99, default=0.0), 2),
            "busy_tick_ms_max": round(max(busy), 2) if busy else 0.0,
            "empty_tick_ms_p50": round(percentile(empty, 50, default=0.0), 3),
            "largest_batch_entries": largest[2],
            "largest_batch_ms": round(largest[1] * 1000, 1),
            "entries_per_s_in_largest_batch": round(largest[2] / largest[1]) if largest[1] else None,
        },
        "dispatch_lag_replayed_ms": {
            "p50": round(percentile(lags, 50, default=0.0), 1),
            "p99": round(percentile(lags, 99, default=0.0), 1),
            "max": round(max(lags), 1) if lags else 0.0,
        },
        "memory": {**memory,
                   "after_fire_delta_per_fired_b": round((mem2 - mem1) / fired_total, 1)
                   if fired_total else None},
        "timings_s": {"register_tenants": round(tenants_s, 2), "load_entries": round(load_s, 2),
                      "simulate": round(run_s, 2)},
    }


def run_bench(client: redis.Redis, base: Settings | None = None, entries: int = 100_000,
              cron: str = DEFAULT_CRON, crons_per_tenant: int = CRONS_PER_TENANT,
              batch_size: int = 1000, seed: int = 7) -> dict[str, Any]:
    """Both modes; returns a JSON-serialisable dict (see module doc)."""
    if entries <= 0:
        raise ValueError(f"entries must be > 0, got {entries}")
    base = base or load_settings(env={})
    cron = validate_cron(cron)
    clock = Stopwatch()
    rng = random.Random(seed)
    plan = tenant_plan(entries, crons_per_tenant, rng)
    boundary_s = (int(time.time()) // 3600 + 1) * 3600
    result: dict[str, Any] = {
        "entries": entries, "cron": cron, "tenants": len(plan), "boundary": iso_utc(boundary_s * 1000),
        "tier_mix": {tier: share for tier, share in TIER_MIX},
        "jitter_windows_s": {t.name: t.jitter_window_s for t in base.tiers},
        "target_peak_over_mean": TARGET_PEAK_OVER_MEAN,
        "modes": {},
    }
    for name, jitter in (("jitter_off", False), ("jitter_on", True)):
        result["modes"][name] = run_mode(client, base, plan, cron, jitter, boundary_s,
                                         batch_size, seed)
    result["elapsed_s"] = clock.elapsed_s()
    return result


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def format_report(result: dict[str, Any]) -> str:
    off, on = result["modes"]["jitter_off"], result["modes"]["jitter_on"]
    lines = [
        f"tenant cron bench: {result['entries']} entries at {result['cron']!r}, "
        f"{result['tenants']} tenants, mix {result['tier_mix']}, "
        f"windows {result['jitter_windows_s']}, boundary {result['boundary']}",
        "",
        f"{'':34}{'jitter off':>14}{'jitter on':>14}",
    ]

    def row(label: str, a: Any, b: Any) -> None:
        lines.append(f"{label:34}{_fmt(a):>14}{_fmt(b):>14}")

    row("fired", off["fired"], on["fired"])
    row("peak fires/s", off["overall"]["peak_per_s"], on["overall"]["peak_per_s"])
    row("peak second (from boundary)", off["overall"]["peak_second"], on["overall"]["peak_second"])
    row(f"mean fires/s in [0,{on['overall']['window_s']}) s", off["overall"]["mean_per_s"],
        on["overall"]["mean_per_s"])
    row("peak/mean overall", off["overall"]["peak_over_mean"], on["overall"]["peak_over_mean"])
    jo, jn = off["jittered_tiers_only"], on["jittered_tiers_only"]
    row("peak/mean jittered tiers only", jo and jo["peak_over_mean"], jn and jn["peak_over_mean"])
    row("busy tick ms p50", off["ticks"]["busy_tick_ms_p50"], on["ticks"]["busy_tick_ms_p50"])
    row("busy tick ms p99", off["ticks"]["busy_tick_ms_p99"], on["ticks"]["busy_tick_ms_p99"])
    row("busy tick ms max", off["ticks"]["busy_tick_ms_max"], on["ticks"]["busy_tick_ms_max"])
    row("empty tick ms p50", off["ticks"]["empty_tick_ms_p50"], on["ticks"]["empty_tick_ms_p50"])
    row("largest batch (entries)", off["ticks"]["largest_batch_entries"],
        on["ticks"]["largest_batch_entries"])
    row("largest batch ms", off["ticks"]["largest_batch_ms"], on["ticks"]["largest_batch_ms"])
    row("entries/s in largest batch", off["ticks"]["entries_per_s_in_largest_batch"],
        on["ticks"]["entries_per_s_in_largest_batch"])
    row("dispatch lag p50 ms (replayed)", off["dispatch_lag_replayed_ms"]["p50"],
        on["dispatch_lag_replayed_ms"]["p50"])
    row("dispatch lag p99 ms (replayed)", off["dispatch_lag_replayed_ms"]["p99"],
        on["dispatch_lag_replayed_ms"]["p99"])
    row("dispatch lag max ms (replayed)", off["dispatch_lag_replayed_ms"]["max"],
        on["dispatch_lag_replayed_ms"]["max"])
    for key, label in (("used_memory_delta_per_entry_b", "memory/entry B (used_memory)"),
                       ("hash_memory_usage_mean_b", "  hash MEMORY USAGE B"),
                       ("payload_memory_usage_mean_b", "  payload string MEMORY USAGE B"),
                       ("zset_memory_usage_per_entry_b", "  zset B per entry"),
                       ("tenant_set_memory_usage_per_entry_b", "  tenant set B per entry"),
                       ("after_fire_delta_per_fired_b", "memory/fired run B (idem. keys)")):
        row(label, off["memory"][key], on["memory"][key])
    row("load entries s", off["timings_s"]["load_entries"], on["timings_s"]["load_entries"])
    row("simulate s", off["timings_s"]["simulate"], on["timings_s"]["simulate"])
    lines += ["", "per tier, jitter on (window = the tier's jitter window capped at the cron period):",
              f"{'tier':18}{'window s':>9}{'fired':>8}{'peak/s':>8}{'mean/s':>9}{'peak/mean':>10}"
              f"{'10s-bins':>10}{'ideal':>8}{'lag p99 ms':>12}"]
    for name, t in on["tiers"].items():
        lines.append(f"{name + ' (' + t['alias'] + ')':18}{t['window_s']:>9}{t['fired']:>8}"
                     f"{t['peak_per_s']:>8}{t['mean_per_s']:>9}{_fmt(t['peak_over_mean']):>10}"
                     f"{_fmt(t['peak_over_mean_10s_buckets']):>10}"
                     f"{_fmt(t['ideal_uniform_peak_over_mean']):>8}"
                     f"{t['dispatch_lag_p99_ms']:>12}")
    lines += ["", "('ideal' = peak/mean that perfectly uniform random offsets give for the same "
              "counts; target <= "
              f"{result['target_peak_over_mean']}; enterprise has no jitter by design, so its runs "
              "all land on the boundary second)", took_line(result["elapsed_s"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from gateway_tasks.cli.main import run_standalone
    return run_standalone("python -m devtools.bench.beat", __doc__.split("\n")[0],
                          add_arguments, run_from_args, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entries", type=int, default=100_000, help="number of crons (100000)")
    parser.add_argument("--cron", default=DEFAULT_CRON, help="cron expression of every entry")
    parser.add_argument("--crons-per-tenant", type=int, default=CRONS_PER_TENANT)
    parser.add_argument("--batch-size", type=int, default=1000, help="due entries per chunk")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    from devtools.bench.storm_report import add_storm_arguments
    add_storm_arguments(parser)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("cron-bench", help="100k crons across an hour boundary, jitter off "
                                                      "vs on; --storm: the cron storm end to end")
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    if getattr(args, "storm", False):
        from devtools.bench.storm_report import run_storm_from_args
        return run_storm_from_args(args)
    clock = Stopwatch()
    settings = load_settings()
    kwargs = dict(entries=args.entries, cron=args.cron, crons_per_tenant=args.crons_per_tenant,
                  batch_size=args.batch_size, seed=args.seed)
    with redis_or_embedded(settings.redis_url) as (url, embedded):
        result = run_bench(redis.Redis.from_url(url), settings, **kwargs)
        result["redis"] = shown_redis(url, embedded)
    result["elapsed_s"] = clock.elapsed_s()   # the whole command, Redis start-up included
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
