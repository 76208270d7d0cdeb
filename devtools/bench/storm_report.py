"""The storm benchmark's report: jitter off and on side by side, then the targets."""

from __future__ import annotations

import argparse
import json
from typing import Any

import redis

from gateway_tasks.core.settings import load_settings
from devtools.bench.targets import format_targets
from devtools.bench.wall_time import Stopwatch, took_line
from devtools.run_redis import redis_or_embedded, shown_redis


def _v(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}{unit}" if abs(value) < 100 else f"{value:,.0f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) else f"{value}{unit}"


MODE_TITLES = {"jitter_off": "jitter off", "jitter_on": "jitter on", "jitter_on_no_lanes": "on, no lanes",
               "jitter_on_no_kept_slots": "on, 0 kept", "jitter_on_tiered": "on, per tier",
               "jitter_on_switch": "on, switch", "jitter_on_python_sim": "on, py sim",
               "jitter_on_no_gc_freeze": "on, no freeze", "jitter_on_no_backlog": "on, no backlog"}


def _on_off(flag: bool | None) -> str | None:
    return {True: "on", False: "off"}.get(flag)   # type: ignore[arg-type]


def _peak_and_when(backlog: dict[str, Any] | None) -> str | None:
    """A BacklogWatch's peak, s of TPM, and when it came, s after the boundary."""
    return f"{backlog['peak_s']} ({backlog['peak_at_s']})" if backlog else None


def format_storm_report(result: dict[str, Any]) -> str:
    spec = result["spec"]
    modes = list(result["modes"].values())
    off, on = result["modes"]["jitter_off"], result["modes"]["jitter_on"]
    lags = on.get("scheduled_lag_tokens") or {}
    lines = [
        f"== cron storm: {off['runs']} runs ({spec['tenants']} tenants x 3 crons, vip/normal/batch "
        f"10/30/60 %) at one minute; time compressed {spec['compress']}x (jitter windows "
        f"{on['tiers']['normal']['jitter_window_s']} s / {on['tiers']['batch']['jitter_window_s']} s); "
        f"upstream {on['quota']['tpm']:,} TPM, {on['quota']['rpm']:,} RPM, burst {on['quota']['burst_s']:g} s; "
        f"{spec['workers']} workers x {spec['concurrency']} threads, {spec['beats']} beat replicas; "
        f"scheduled lane lag {', '.join(f'{t} {n}' for t, n in lags.items()) or '-'} tokens; "
        f"worker slots kept for vip {on.get('reserved_worker_slots', '-')}",
        f"{'':<44}" + "".join(f"{MODE_TITLES.get(m['mode'], m['mode']):>14}" for m in modes),
    ]

    def row(label: str, *values: Any) -> None:
        lines.append(f"  {label:<42}" + "".join(f"{_v(v):>14}" for v in values))

    def each(get: Any) -> list[Any]:
        return [get(m) for m in modes]

    row("worker GIL switch interval, ms", *each(lambda m: m.get("worker_switch_interval_ms")))
    row("worker gc freeze", *each(lambda m: _on_off(m.get("worker_gc_freeze"))))
    row("simulator HTTP stack", *each(lambda m: m.get("sim_stack")))
    row("overload backlog signal", *each(lambda m: _on_off(m.get("backlog_signal"))))
    row("worker threads (vip/normal/batch)",
        *each(lambda m: "/".join(str(n) for n in (m.get("worker_threads") or {}).values()) or None))
    row("runs completed", *each(lambda m: f"{m['completed']}/{m['runs']}"))
    row("runs deferred at submit (load level)", *each(lambda m: m.get("deferred_at_submit", 0)))
    row("storm length (B to last result), s", *each(lambda m: m["storm_s"]))
    row("load level L3 reached, s after B", *each(lambda m: m.get("l3_at_s")))
    row("queue backlog peak, s of TPM (at s after B)",
        *each(lambda m: _peak_and_when(m.get("backlog"))))
    row("upstream requests/s peak (1 s bins)", *each(lambda m: m["upstream"]["rate"]["peak_per_s"]))
    row("upstream requests/s mean", *each(lambda m: m["upstream"]["rate"]["mean_per_s"]))
    row("upstream peak/mean (1 s bins)", *each(lambda m: m["upstream"]["rate"]["peak_over_mean"]))
    row("upstream peak/mean (5 s bins)", *each(lambda m: m["upstream"]["rate_5s"]["peak_over_mean"]))
    row("upstream 429s (% of answers)",
        *each(lambda m: f"{m['upstream']['requests_429']} ({m['upstream']['rate_429_pct']} %)"))
    row("gateway requeues after a 429", *each(lambda m: m["requeued_after_429"]))
    row("tasks held in the queue >= 1 s", *each(lambda m: m["deferred"]))
    for tier in ("vip", "normal", "batch"):
        row(f"{tier} end-to-end p50, ms", *each(lambda m: m["tiers"][tier]["e2e"]["p50_ms"]))
        row(f"{tier} end-to-end p99, ms", *each(lambda m: m["tiers"][tier]["e2e"]["p99_ms"]))
        row(f"{tier} from scheduled time p50, ms", *each(lambda m: m["tiers"][tier]["from_scheduled"]["p50_ms"]))
        row(f"{tier} from scheduled time p99, ms", *each(lambda m: m["tiers"][tier]["from_scheduled"]["p99_ms"]))
        row(f"{tier} held >= 1 s / deferred at submit",
            *each(lambda m: f"{m['tiers'][tier]['deferred']}/{m['tiers'][tier].get('deferred_at_submit', 0)}"))
        row(f"{tier} beat fire lag p99, ms", *each(lambda m: m["tiers"][tier]["fire_lag_p99_ms"]))
    row("VIP probe p99 before the storm, ms", *each(lambda m: m["vip_probe"]["quiet"]["p99_ms"]))
    row("VIP probe p99 during the storm, ms", *each(lambda m: m["vip_probe"]["storm"]["p99_ms"]))
    for part, label in (("queue_wait", "queue wait"), ("upstream", "upstream call"),
                        ("upstream_own", "... at the simulator"), ("upstream_outside", "... outside it"),
                        ("worker", "rest of the worker")):
        row(f"VIP probe {label} p99 before / during, ms",
            *each(lambda m: f"{_v(m['vip_probe']['quiet'].get(part + '_p99_ms'))}/"
                            f"{_v(m['vip_probe']['storm'].get(part + '_p99_ms'))}"))
    row("VIP probe p99 storm/quiet", *each(lambda m: m["vip_probe"]["p99_ratio"]))
    row("... while VIP runs were queued: p99, ms", *each(lambda m: (m["vip_probe"].get("vip_runs") or {}).get("p99_ms")))
    row("... its queue wait p99, ms",
        *each(lambda m: (m["vip_probe"].get("vip_runs") or {}).get("queue_wait_p99_ms")))
    row("... p99 / quiet p99 (window, s)",
        *each(lambda m: f"{_v(m['vip_probe'].get('vip_runs_p99_ratio'))} "
                        f"({_v((m['vip_probe'].get('vip_runs') or {}).get('window_s'))})"))
    row("load average (1 min) at the end", *each(lambda m: (m.get("load_avg") or [None])[0]))
    for mode in modes:
        lines.append(f"  upstream requests per second, {mode['mode']}: "
                     + " ".join(str(n) for n in mode["upstream"]["series"]))
    for mode in modes:
        for change in mode.get("levels") or []:
            lines.append(f"  load level, {mode['mode']}: {change['at_s']:+.1f} s L{change['from']} -> "
                         f"L{change['to']} ({change['reason']})")
    lines += format_targets(result["targets"])
    return "\n".join(lines)


# the on/off comparisons, each another run with jitter on (StormSpec's field of the same name)
COMPARISONS = {
    "--compare-lanes": "no scheduled lane (lag 0)",
    "--compare-slots": "no worker slot kept for vip (reserved_worker_slots 0)",
    "--compare-layout": "one worker per tier (deploy/k8s's layout, the same threads in all: a quarter vip, "
                        "the rest halved)",
    "--compare-sim-stack": "the simulator on the pure-Python HTTP stack (asyncio + h11)",
    "--compare-gc-freeze": "the workers' startup objects left to full garbage collections (worker_gc_freeze off)",
    "--compare-backlog": "the load level blind to the queue's backlog (overload backlog_signal off)",
}


def add_storm_arguments(parser: argparse.ArgumentParser) -> None:
    from devtools.bench.storm import StormSpec
    from gateway_tasks.simulator.config import SERVER_STACKS

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
    g.add_argument("--scheduled-lag-tokens", type=int, default=None,
                   help="every tier's scheduled lane lag (default: the settings'; 0 = no lanes)")
    for flag, change in COMPARISONS.items():
        g.add_argument(flag, action="store_true",
                       help=f"another run: jitter on with {change}, side by side (~+100 s)")
    g.add_argument("--sim-stack", choices=sorted(SERVER_STACKS), default=d.sim_stack,
                   help="the simulator's HTTP stack: native = uvloop + httptools, python = asyncio + h11 "
                        "(%(default)s)")
    g.add_argument("--compare-switch", type=float, default=None, metavar="MS",
                   help="another run: jitter on with the workers' GIL switch interval MS "
                        "(worker_switch_interval_ms), side by side (~+100 s)")


def spec_from_args(args: argparse.Namespace) -> Any:
    """The StormSpec the parsed flags ask for."""
    from devtools.bench.storm import StormSpec

    compared = {flag.removeprefix("--").replace("-", "_") for flag in COMPARISONS}
    return StormSpec(tenants=args.tenants, compress=args.compress, quota_fill=args.quota_fill,
                     workers=args.storm_workers, beats=args.storm_beats,
                     scheduled_lag_tokens=args.scheduled_lag_tokens, compare_switch_ms=args.compare_switch,
                     sim_stack=args.sim_stack, **{name: getattr(args, name) for name in compared})


def run_storm_from_args(args: argparse.Namespace) -> int:
    from devtools.bench.storm import run_storm, storm_modes, storm_settings

    clock = Stopwatch()
    spec = spec_from_args(args)
    settings = load_settings()
    for run in storm_modes(spec):      # a bad comparison value fails before any run, not after
        storm_settings(settings, spec, run, settings.key_prefix, settings.pools[0])
    with redis_or_embedded(settings.redis_url) as (url, embedded):
        progress = (lambda _m: None) if args.json else (lambda m: print(m, flush=True))
        result = run_storm(redis.Redis.from_url(url), settings.with_(redis_url=url), spec, progress)
        result["redis"] = shown_redis(url, embedded)
    result["elapsed_s"] = clock.elapsed_s()
    print(json.dumps(result, indent=2) if args.json else format_storm_report(result) + "\n"
          + took_line(result["elapsed_s"]))
    return 0
