"""The storm benchmark's report: jitter off and on side by side, then the targets."""

from __future__ import annotations

import argparse
import json
from typing import Any

import redis

from gateway_tasks.core.settings import load_settings
from gateway_tasks.devtools.bench.targets import format_targets
from gateway_tasks.devtools.bench.wall_time import Stopwatch, took_line
from gateway_tasks.devtools.redis_server import redis_or_embedded, shown_redis


def _v(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}{unit}" if abs(value) < 100 else f"{value:,.0f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) else f"{value}{unit}"


def format_storm_report(result: dict[str, Any]) -> str:
    spec = result["spec"]
    off, on = result["modes"]["jitter_off"], result["modes"]["jitter_on"]
    lines = [
        f"== cron storm: {off['runs']} runs ({spec['tenants']} tenants x 3 crons, vip/normal/batch "
        f"10/30/60 %) at one minute; time compressed {spec['compress']}x (jitter windows "
        f"{on['tiers']['normal']['jitter_window_s']} s / {on['tiers']['batch']['jitter_window_s']} s); "
        f"upstream {on['quota']['tpm']:,} TPM, {on['quota']['rpm']:,} RPM, burst {on['quota']['burst_s']:g} s; "
        f"{spec['workers']} workers x {spec['concurrency']} threads, {spec['beats']} beat replicas",
        f"{'':<44}{'jitter off':>14}{'jitter on':>14}",
    ]

    def row(label: str, a: Any, b: Any) -> None:
        lines.append(f"  {label:<42}{_v(a):>14}{_v(b):>14}")

    row("runs completed", f"{off['completed']}/{off['runs']}", f"{on['completed']}/{on['runs']}")
    row("storm length (B to last result), s", off["storm_s"], on["storm_s"])
    row("upstream requests/s peak (1 s bins)", off["upstream"]["rate"]["peak_per_s"],
        on["upstream"]["rate"]["peak_per_s"])
    row("upstream requests/s mean", off["upstream"]["rate"]["mean_per_s"], on["upstream"]["rate"]["mean_per_s"])
    row("upstream peak/mean (1 s bins)", off["upstream"]["rate"]["peak_over_mean"],
        on["upstream"]["rate"]["peak_over_mean"])
    row("upstream peak/mean (5 s bins)", off["upstream"]["rate_5s"]["peak_over_mean"],
        on["upstream"]["rate_5s"]["peak_over_mean"])
    row("upstream 429s (% of answers)", f"{off['upstream']['requests_429']} ({off['upstream']['rate_429_pct']} %)",
        f"{on['upstream']['requests_429']} ({on['upstream']['rate_429_pct']} %)")
    row("gateway requeues after a 429", off["requeued_after_429"], on["requeued_after_429"])
    row("tasks deferred (queued >= 1 s)", off["deferred"], on["deferred"])
    for tier in ("vip", "normal", "batch"):
        a, b = off["tiers"][tier], on["tiers"][tier]
        row(f"{tier} end-to-end p50, ms", a["e2e"]["p50_ms"], b["e2e"]["p50_ms"])
        row(f"{tier} end-to-end p99, ms", a["e2e"]["p99_ms"], b["e2e"]["p99_ms"])
        row(f"{tier} from scheduled time p50, ms", a["from_scheduled"]["p50_ms"], b["from_scheduled"]["p50_ms"])
        row(f"{tier} from scheduled time p99, ms", a["from_scheduled"]["p99_ms"], b["from_scheduled"]["p99_ms"])
        row(f"{tier} deferred", a["deferred"], b["deferred"])
        row(f"{tier} beat fire lag p99, ms", a["fire_lag_p99_ms"], b["fire_lag_p99_ms"])
    row("VIP probe p99 before the storm, ms", off["vip_probe"]["quiet"]["p99_ms"],
        on["vip_probe"]["quiet"]["p99_ms"])
    row("VIP probe p99 during the storm, ms", off["vip_probe"]["storm"]["p99_ms"],
        on["vip_probe"]["storm"]["p99_ms"])
    row("VIP probe queue wait p99 during it, ms", off["vip_probe"]["storm"].get("queue_wait_p99_ms"),
        on["vip_probe"]["storm"].get("queue_wait_p99_ms"))
    row("VIP probe p99 storm/quiet", off["vip_probe"]["p99_ratio"], on["vip_probe"]["p99_ratio"])
    for mode in (off, on):
        lines.append(f"  upstream requests per second, {mode['mode']}: "
                     + " ".join(str(n) for n in mode["upstream"]["series"]))
    lines += format_targets(result["targets"])
    return "\n".join(lines)


def add_storm_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway_tasks.devtools.bench.storm import StormSpec

    d = StormSpec()
    g = parser.add_argument_group("--storm (end to end: beat replicas, workers, simulator)")
    g.add_argument("--storm", action="store_true",
                   help="run the cron storm end to end instead of the scheduler-only bench")
    g.add_argument("--tenants", type=int, default=d.tenants, help="storm tenants, 3 crons each (%(default)s)")
    g.add_argument("--compress", type=int, default=d.compress,
                   help="divide the jitter windows by this (time compression, %(default)s)")
    g.add_argument("--quota-fill", type=float, default=d.quota_fill,
                   help="storm tokens / quota over the compressed batch window (%(default)s)")
    g.add_argument("--storm-workers", type=int, default=d.workers, help="worker processes (%(default)s)")
    g.add_argument("--storm-beats", type=int, default=d.beats, help="beat replicas (%(default)s)")


def run_storm_from_args(args: argparse.Namespace) -> int:
    from gateway_tasks.devtools.bench.storm import StormSpec, run_storm

    clock = Stopwatch()
    spec = StormSpec(tenants=args.tenants, compress=args.compress, quota_fill=args.quota_fill,
                     workers=args.storm_workers, beats=args.storm_beats)
    settings = load_settings()
    with redis_or_embedded(settings.redis_url) as (url, embedded):
        progress = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
        result = run_storm(redis.Redis.from_url(url), settings.with_(redis_url=url), spec, progress)
        result["redis"] = shown_redis(url, embedded)
    result["elapsed_s"] = clock.elapsed_s()
    print(json.dumps(result, indent=2) if args.json else format_storm_report(result) + "\n"
          + took_line(result["elapsed_s"]))
    return 0
