"""`gateway-dev bench-strict`: a pool in front of a strict sliding-window upstream.

The upstream simulator in ``window="strict"`` mode: at most ``tpm`` tokens (prompt +
max_tokens, charged at admission, never given back) and ``rpm`` requests in any 60 s, an
exact Retry-After on a 429.  The pool says so (``Pool.window = "strict"``, a short
``burst_s``).  Normal-tier tenants offer ``--load`` times the quota for ``--duration-s``
seconds; one worker process serves them.  Printed per run, from the simulator's
per-second admission series:

* quota used after the first minute: what the upstream's 60 s window holds / the quota,
  averaged over every second from the end of the first minute on (target >= 95 %);
* 429s / requests that reached the upstream (target <= 0.3 %);
* requests admitted per 10 s window and the fewest in one (target: none empty -- work is
  queued all the time at 3x);

and, over the runs, the spread (min-max) of each.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

import redis

from devtools import processes
from devtools.bench import command as bench_command
from devtools.quotas import for_load
from devtools.bench.load import end_run
from gateway_tasks.core.settings import Pool, Settings, load_settings
from gateway_tasks.local.redis_server import EmbeddedRedis, redis_server_binary
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.simulator import SimConfig, SimulatorProcess

MODEL = "gpt-4o-mini"
WINDOW_S = 10             # requests are counted per this many seconds
FIRST_MINUTE_S = 60       # quota use is measured after it (the window fills during it)
TARGET_QUOTA_USED_PCT = 95.0
TARGET_429_PCT = 0.3

Progress = Callable[[str], None]


@dataclass(frozen=True)
class StrictSpec:
    tpm: int = 60_000
    rpm: int = 10_000
    burst_s: float = 1.0
    load: float = 3.0              # offered load / the quota
    duration_s: float = 150.0
    tenants: int = 20
    max_tokens: int = 200
    completion_fraction: float = 0.5   # the upstream answers with half of max_tokens
    concurrency: int = 8
    runs: int = 3
    pool_window: str = "strict"    # the pool's Pool.window ("bucket": the mismatch, for comparison)


def window_figures(admitted: dict[str, Any], start_second: int, duration_s: float, tpm: int,
                   requests_429: int) -> dict[str, Any]:
    """The run's figures from the simulator's ``admitted_per_s`` series (pure): requests per
    10 s window from ``start_second``, the fewest in a whole window, quota used after the first
    minute (tokens charged / the quota over that time) and the 429 share."""
    first = int(admitted["first_second"])
    tokens, requests = admitted["tokens"], admitted["requests"]

    def at(series: Sequence[int], second: int) -> int:
        i = second - first
        return int(series[i]) if 0 <= i < len(series) else 0

    whole = int(duration_s) // WINDOW_S
    per_window = [sum(at(requests, start_second + w * WINDOW_S + s) for s in range(WINDOW_S))
                  for w in range(whole)]
    # the upstream's own measure: the tokens its 60 s window holds, at each second from the
    # end of the first minute on, / the quota -- averaged
    ends = range(start_second + FIRST_MINUTE_S, start_second + int(duration_s) + 1)
    uses = [sum(at(tokens, s) for s in range(end - FIRST_MINUTE_S, end)) / tpm for end in ends]
    admitted_n = sum(per_window)
    return {
        "requests_per_10s": per_window,
        "min_window_requests": min(per_window) if per_window else 0,
        "quota_used_after_first_minute_pct": round(100.0 * sum(uses) / len(uses), 2) if uses else 0.0,
        "upstream_429_pct": round(100.0 * requests_429 / max(1, admitted_n + requests_429), 3),
        "requests_admitted": admitted_n,
        "requests_429": requests_429,
    }


def offer(gw: Gateway, tenants: Sequence[str], rate_per_s: float, until: float, max_tokens: int,
          stop: threading.Event) -> int:
    """Submit at ``rate_per_s`` round-robin over ``tenants`` until the monotonic ``until``."""
    i, t0 = 0, time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now >= until:
            break
        due = int((now - t0) * rate_per_s) + 1
        while i < due:
            gw.submit(tenants[i % len(tenants)], f"summarise item {i}", max_tokens=max_tokens, source="bench")
            i += 1
        time.sleep(0.01)
    return i


def run_once(base: Settings, redis_url: str, spec: StrictSpec, log_dir: str, progress: Progress) -> dict[str, Any]:
    prefix = f"gt-bench-strict-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(redis_url)
    sim_config = SimConfig(tpm=spec.tpm, rpm=spec.rpm, window="strict", base_latency_ms=20.0,
                           completion_fraction=spec.completion_fraction, models=(MODEL,))
    worker = gw = None
    try:
        with SimulatorProcess(sim_config) as sim:
            pool = Pool("default", base_url=sim.base_url, api_key="sk-bench", models=(MODEL,), tpm=spec.tpm,
                        rpm=spec.rpm, burst_s=spec.burst_s, window=spec.pool_window)
            settings = for_load(base.with_(redis_url=redis_url, key_prefix=prefix, pools=(pool,),
                                           overload=replace(base.overload, enabled=False)))
            gw = Gateway(settings, client=client)
            tenants = [f"t{k}" for k in range(spec.tenants)]
            for tenant in tenants:
                gw.register_tenant(tenant, "normal")
            per_task = gw.estimate(tenants[0], "summarise item 0", max_tokens=spec.max_tokens).est_tokens
            rate = spec.load * spec.tpm / 60.0 / per_task
            worker = processes.worker(settings, concurrency=spec.concurrency, name="bench-strict",
                                      log_path=os.path.join(log_dir, f"worker-{prefix[:-1]}.log")).start()
            processes.wait_for_workers(gw.app, 1, timeout_s=60.0)
            sim.reset_stats()
            start_second = int(sim.stats()["now_monotonic"]) + 1
            while int(sim.stats()["now_monotonic"]) < start_second:
                time.sleep(0.02)
            progress(f"  offering {rate:.1f} tasks/s ({spec.load:g}x the quota) for {spec.duration_s:g} s")
            stop = threading.Event()
            submitted = offer(gw, tenants, rate, time.monotonic() + spec.duration_s, spec.max_tokens, stop)
            time.sleep(1.5)   # the last second closes in the simulator's series
            upstream = sim.stats()
            worker.stop()
            worker = None
    finally:
        end_run(client, prefix, worker=worker, gw=gw)
    out = window_figures(upstream["admitted_per_s"], start_second, spec.duration_s, spec.tpm,
                         int(upstream["requests_429"]))
    out["submitted"] = submitted
    return out


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "mean": round(sum(values) / len(values), 3)}


def run_bench(base: Settings, redis_url: str, spec: StrictSpec, log_dir: str, progress: Progress) -> dict[str, Any]:
    runs = []
    for k in range(spec.runs):
        progress(f"run {k + 1} of {spec.runs}")
        runs.append(run_once(base, redis_url, spec, log_dir, progress))
    used = [r["quota_used_after_first_minute_pct"] for r in runs]
    r429 = [r["upstream_429_pct"] for r in runs]
    gaps = [r["min_window_requests"] for r in runs]
    result = {
        "config": asdict(spec),
        "runs": runs,
        "quota_used_after_first_minute_pct": spread(used),
        "upstream_429_pct": spread(r429),
        "min_window_requests": spread(gaps),
        "targets": {
            "quota_used_after_first_minute_pct>=95": min(used) >= TARGET_QUOTA_USED_PCT,
            "upstream_429_pct<=0.3": max(r429) <= TARGET_429_PCT,
            "no_empty_10s_window": min(gaps) > 0,
        },
    }
    result["all_targets_pass"] = all(result["targets"].values())
    return result


def format_report(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"gateway-dev bench-strict: a strict 60 s sliding-window upstream, tpm {c['tpm']}, "
             f"offered {c['load']:g}x for {c['duration_s']:g} s, pool window {c['pool_window']!r} "
             f"burst_s {c['burst_s']:g} "
             f"({c['runs']} runs)"]
    for k, run in enumerate(result["runs"]):
        lines.append(f"  run {k + 1}: quota used after the first minute {run['quota_used_after_first_minute_pct']:.1f} %, "
                     f"429s {run['upstream_429_pct']:.2f} % ({run['requests_429']} of "
                     f"{run['requests_admitted'] + run['requests_429']}), fewest requests in a 10 s window "
                     f"{run['min_window_requests']}")
        lines.append(f"         requests per 10 s: {' '.join(str(n) for n in run['requests_per_10s'])}")

    def line(name: str, key: str, unit: str, target: str) -> str:
        s = result[key]
        return f"  {name:<38} {s['min']:>7} .. {s['max']:<7} (mean {s['mean']}){unit}   target {target}"

    lines.append(line("quota used after the first minute", "quota_used_after_first_minute_pct", " %", ">= 95 %"))
    lines.append(line("429s / requests", "upstream_429_pct", " %", "<= 0.3 %"))
    lines.append(line("fewest requests in a 10 s window", "min_window_requests", "", "> 0"))
    lines.append("  targets: " + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in result["targets"].items()))
    return "\n".join(lines)


def spec_from_args(args: argparse.Namespace) -> StrictSpec:
    spec = StrictSpec(load=args.load, runs=args.runs, duration_s=args.duration_s, burst_s=args.burst_s,
                      pool_window=args.pool_window)
    if args.quick:
        spec = replace(spec, duration_s=min(spec.duration_s, 90.0), runs=min(spec.runs, 2))
    return spec


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    log_dir = bench_command.log_dir_of(args, "bench-strict")
    base = load_settings()
    with EmbeddedRedis(binary=redis_server_binary()) as server:
        result = run_bench(base, server.url, spec, log_dir, bench_command.progress)
    return bench_command.finish(args, result, format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = StrictSpec()
    parser.add_argument("--load", type=float, default=d.load, help="offered load / the quota (default %(default)s)")
    parser.add_argument("--duration-s", type=float, default=d.duration_s, help="seconds offered (default %(default)s)")
    parser.add_argument("--burst-s", type=float, default=d.burst_s, help="the pool's burst_s (default %(default)s)")
    parser.add_argument("--pool-window", choices=("strict", "bucket"), default=d.pool_window,
                        help="the pool's window setting (bucket: as a pool that does not know; use "
                             "--burst-s 60 with it) (default %(default)s)")
    parser.add_argument("--runs", type=int, default=d.runs, help="runs (default %(default)s)")
    bench_command.add_common_arguments(parser)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-strict",
                           "a pool in front of a strict sliding-window upstream: quota use, 429s, idle windows",
                           __doc__, add_arguments, run)


if __name__ == "__main__":
    import sys
    sys.exit(bench_command.standalone(__name__, __doc__, add_arguments, run, None))
