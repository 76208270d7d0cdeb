"""`gateway-dev bench-inherit`: priority inheritance down a chain, under a batch flood.

Per run, on a fresh key prefix, one worker and the upstream simulator, with the load
controller on (the settings' own): a flood of batch tasks from 20 tenants saturates the pool;
once it flows, two chains of the same shape are submitted at the same moment:

* inherited: V (vip) depends on M (batch, held), which depends on A (batch, queued behind
  its own tenant's share of the flood) -- V lends its tier down the chain;
* control: M' depends on A' (batch, behind another tenant's share), no one above them
  (both chains' batch tasks are submitted before the flood is served: the load level
  defers new batch work once it flows).

Printed per run and as the spread over runs (min / median / max): the inherited chain's
time from V's submit to V's result, the control chain's from its submit to M''s result,
their ratio, and how many flood tasks were still queued when V completed.  Target: the
inherited chain completes in under 2 s while the flood is queued.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import redis

from devtools import processes
from devtools.bench import command as bench_command
from devtools.bench.main import run_on_bench_redis
from devtools.quotas import for_load
from devtools.run_redis import discard_prefix
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.simulator import SimConfig, SimulatorProcess

TARGET_CHAIN_MS = 2_000
FLOOD_TENANTS = 20
Progress = Callable[[str], None]


@dataclass(frozen=True)
class InheritSpec:
    runs: int = 3
    flood: int = 300
    tpm: int = 60_000
    concurrency: int = 8


def run_once(base: Settings, redis_url: str, spec: InheritSpec, log_dir: str, k: int) -> dict[str, Any]:
    prefix = f"gt-bench-inherit-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(redis_url)
    worker = gw = None
    try:
        with SimulatorProcess(SimConfig(tpm=spec.tpm, rpm=6_000, burst_s=2, base_latency_ms=20)) as sim:
            pool = Pool("default", base_url=sim.base_url, api_key="sk-bench", models=("gpt-4o-mini",),
                        tpm=spec.tpm, rpm=6_000, burst_s=2)
            settings = for_load(base.with_(redis_url=redis_url, key_prefix=prefix, pools=(pool,)))
            gw = Gateway(settings, client=client)
            tenants = [f"bulk{i}" for i in range(FLOOD_TENANTS)]
            for t in tenants:
                gw.register_tenant(t, "batch")
            gw.register_tenant("acme", "vip")
            flood = [gw.submit(tenants[i % FLOOD_TENANTS], f"flood {i}", max_tokens=60) for i in range(spec.flood)]
            parent = gw.submit("acme", "the agent's request", max_tokens=5)
            a = gw.submit("bulk1", "leaf", max_tokens=60)
            m = gw.submit("bulk1", "middle", max_tokens=60, depends_on=[a.id], on_behalf_of=parent.id)
            a2 = gw.submit("bulk2", "control leaf", max_tokens=60)
            m2 = gw.submit("bulk2", "control middle", max_tokens=60, depends_on=[a2.id])
            gw.cancel(parent.id)               # the sharing stays; nothing is lent until V
            worker = processes.worker(settings, concurrency=spec.concurrency, name="bench-inherit",
                                      log_path=os.path.join(log_dir, f"worker-inherit-{k}.log")).start()
            processes.wait_for_workers(gw.app, 1, timeout_s=60.0)
            flood[FLOOD_TENANTS].get(timeout=60)
            submitted_ms = int(time.time() * 1000)
            v = gw.submit("acme", "needs the middle", max_tokens=20, depends_on=[m.id])
            done_v = v.get(timeout=120)
            queued = sum(1 for h in flood if h.status == "PENDING")
            done_m2 = m2.get(timeout=300)
    finally:
        if worker is not None:
            worker.stop()
        if gw is not None:
            gw.app.close()
        discard_prefix(client, prefix)
    chain_ms = done_v["timing"]["completed_ms"] - submitted_ms
    control_ms = done_m2["timing"]["completed_ms"] - submitted_ms
    return {"chain_ms": chain_ms, "control_ms": control_ms, "ratio": round(chain_ms / max(1, control_ms), 3),
            "flood_queued_at_v": queued, "level_enabled": settings.overload.enabled}


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run_inherit(base: Settings, redis_url: str, spec: InheritSpec, *, log_dir: str, redis_note: str = "",
                progress: Progress = lambda _: None) -> dict[str, Any]:
    runs = []
    for k in range(spec.runs):
        progress(f"bench-inherit: run {k + 1} of {spec.runs}")
        runs.append(run_once(base, redis_url, spec, log_dir, k))
    chain = spread([r["chain_ms"] for r in runs])
    out = {"spec": spec.__dict__, "redis": redis_note, "runs": runs, "chain_ms": chain,
           "control_ms": spread([r["control_ms"] for r in runs]),
           "ratio": spread([r["ratio"] for r in runs]),
           "flood_queued_at_v": spread([r["flood_queued_at_v"] for r in runs]),
           "target_chain_ms": TARGET_CHAIN_MS}
    out["all_targets_pass"] = chain["max"] < TARGET_CHAIN_MS
    return out


def format_report(result: dict[str, Any]) -> str:
    s = result["spec"]
    fmt = lambda d, unit="": f"{d['min']:g} / {d['median']:g} / {d['max']:g}{unit}"  # noqa: E731
    lines = [f"gateway-dev bench-inherit: V (vip) -> M (batch, held) -> A (batch, queued) under a "
             f"{s['flood']}-task batch flood, {s['tpm']} TPM, load controller on; {s['runs']} runs "
             f"(min / median / max)",
             f"  inherited chain, V's submit to V's result   {fmt(result['chain_ms'], ' ms')}"
             f"   target < {result['target_chain_ms']} ms: {'PASS' if result['all_targets_pass'] else 'FAIL'}",
             f"  control chain M' -> A', no one above it      {fmt(result['control_ms'], ' ms')}",
             f"  ratio inherited / control                   {fmt(result['ratio'])}",
             f"  flood tasks still queued when V completed   {fmt(result['flood_queued_at_v'])}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    spec = InheritSpec(runs=1 if args.quick else args.runs, flood=150 if args.quick else args.flood)
    return run_on_bench_redis(args, "bench-inherit", lambda base, url, **kw: run_inherit(base, url, spec, **kw),
                              format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=InheritSpec.runs, help="runs (default %(default)s)")
    parser.add_argument("--flood", type=int, default=InheritSpec.flood,
                        help="batch tasks flooding the pool (default %(default)s)")
    bench_command.add_common_arguments(parser)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-inherit",
                           "priority inheritance down a chain of dependencies under a batch flood",
                           __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return bench_command.standalone("devtools.bench.inherit", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
