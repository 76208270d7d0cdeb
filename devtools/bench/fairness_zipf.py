"""`gateway-dev bench-fairness --scenario zipf`: fair in latency at scale, through real workers.

Two scenarios per run, each on a fresh key prefix with its own simulator and one gateway
worker (threads): **scale** -- ``tenants`` normal-tier tenants (10,000 by default) whose
requests arrive as a Poisson stream at ``load`` x the pool's capacity (2x), each request's
tenant drawn by Zipf(``zipf_s``) rank -- and **baseline** -- the same stream over
``baseline_tenants`` (10).  Tenant ids are random hex, so where an id sorts is unrelated to
its rank.  Requests arrive for ``duration_s``; then the run waits (``grace_s`` at most)
for the small tenants' requests (devtools/bench/fairness_zipf_report.py) to be answered,
and drops the big tenants' backlog.

It prints the small tenants' queue waits (p50 / p99 / max) in both scenarios and their
ratio (target: scale within 2x the baseline), the same per quartile of ids with the run's
noise beside them (target: no quartile apart by more than chance), and Jain's index of
tokens served against the max-min fair share; several runs with their spread.  The
load-level controller is off: the scenario measures the pick order, not degradation.

    gateway-dev bench-fairness --scenario zipf [--tenants N] [--duration S] [--runs N] [--quick]

Where each number comes from: each task's result (``timing.queue_wait_ms`` =
dispatched_ms - enqueued_ms on the Redis clock, ``tokens.total`` as the upstream reported).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import redis

from devtools import processes
from devtools.bench import fairness_zipf_report as report
from devtools.bench.load import end_run, TierLoad, count_results, read_results
from devtools.bench.main import run_on_bench_redis
from devtools.quotas import for_load
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.simulator import SimConfig, SimulatorProcess

MODEL = "gpt-4o-mini"
TIER = "normal"
LOAD = TierLoad("Request {i}: answer this customer's question about their order in two sentences.", 120, 110)
Progress = Callable[[str], None]
# Jain's index counts the requests sent before the window's last tenth, served by its end
MEASURE_TAIL = 0.1


def redis_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


@dataclass(frozen=True)
class ZipfSpec:
    tenants: int = 10_000
    baseline_tenants: int = 10
    zipf_s: float = 1.1
    load: float = 2.0              # offered / the pool's capacity
    duration_s: float = 60.0
    runs: int = 3
    tpm: int = 120_000
    rpm: int = 60_000              # far above the request rate: TPM binds
    burst_s: float = 2.0
    base_latency_ms: float = 100.0
    ms_per_output_token: float = 1.0
    concurrency: int = 16
    grace_s: float = 60.0          # after the arrivals: wait this long at most for small tenants
    seed: int = 1


QUICK = {"duration_s": 20.0, "runs": 1}


def arrivals(spec: ZipfSpec, tenants: int, rate_per_s: float, rng: random.Random) -> tuple[list[str], list[tuple[float, str]]]:
    """Random ids by Zipf rank (rank 1 first) and the (offset s, tenant) arrivals: a
    Poisson stream at ``rate_per_s`` for ``duration_s``, each tenant drawn by its rank."""
    ids = [f"z{rng.getrandbits(48):012x}" for _ in range(tenants)]
    cum = list(itertools.accumulate(report.zipf_weights(tenants, spec.zipf_s)))
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= spec.duration_s:
            return ids, out
        out.append((t, ids[min(len(ids) - 1, bisect.bisect_left(cum, rng.random() * cum[-1]))]))


def run_scenario(base: Settings, redis_url: str, spec: ZipfSpec, tenants: int, seed: int, *, log_dir: str,
                 progress: Progress) -> dict[str, Any]:
    prefix = f"gt-bench-zipf-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(redis_url)
    worker = gw = None
    sim_config = SimConfig(tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s, base_latency_ms=spec.base_latency_ms,
                           ms_per_output_token=spec.ms_per_output_token, models=(MODEL,))
    try:
        with SimulatorProcess(sim_config) as sim:
            pool = Pool("default", base_url=sim.base_url, api_key="sk-bench", models=(MODEL,),
                        tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s)
            settings = for_load(base.with_(redis_url=redis_url, key_prefix=prefix, pools=(pool,),
                                           overload=replace(base.overload, enabled=False)))
            gw = Gateway(settings, client=client)
            probe = "probe"
            gw.register_tenant(probe, TIER)
            per_task = gw.estimate(probe, LOAD.prompt.format(i=0), max_tokens=LOAD.max_tokens).prompt_tokens \
                + LOAD.completion_tokens
            capacity = spec.tpm / 60.0 / per_task
            rng = random.Random(seed)
            ids, plan = arrivals(spec, tenants, spec.load * capacity, rng)
            sending = sorted({t for _, t in plan})
            expected = {t: spec.load * capacity * w for t, w in zip(ids, report.zipf_weights(tenants, spec.zipf_s))}
            small = report.small_tenants(expected, capacity)
            for t in sending:
                gw.register_tenant(t, TIER)
            worker = processes.worker(settings, concurrency=spec.concurrency, name="bench-zipf",
                                      log_path=os.path.join(log_dir, f"worker-zipf-{tenants}.log")).start()
            processes.wait_for_workers(gw.app, 1, timeout_s=60.0)
            progress(f"  {tenants} tenants: {len(plan)} requests from {len(sending)} tenants over "
                     f"{spec.duration_s:g} s ({spec.load * capacity:.1f}/s against {capacity:.1f}/s)")
            task_of: dict[str, list[str]] = {}
            cut_s = spec.duration_s * (1 - MEASURE_TAIL)
            measured = {t: 0 for t in sending}
            for at, tenant in plan:
                if at <= cut_s:
                    measured[tenant] += 1
            t0_ms = redis_ms(client)
            t0 = time.monotonic()
            for i, (at, tenant) in enumerate(plan):
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                handle = gw.submit(tenant, LOAD.prompt.format(i=i), max_tokens=LOAD.max_tokens, source="bench",
                                   extra_body={"sim_completion_tokens": LOAD.completion_tokens})
                task_of.setdefault(tenant, []).append(handle.id)
            window_end_ms = redis_ms(client)
            small_ids = [x for t, v in task_of.items() if t in small for x in v]
            deadline = time.monotonic() + spec.grace_s
            while time.monotonic() < deadline and count_results(client, gw.app, small_ids) < len(small_ids):
                time.sleep(0.5)
            worker.stop()
            worker = None
            results = read_results(client, gw.app, [x for v in task_of.values() for x in v])
    finally:
        end_run(client, prefix, worker=worker, gw=gw)
    out = report.scenario(ids, small, {t: len(v) for t, v in task_of.items()}, results, measured=measured,
                          cut_ms=t0_ms + int(cut_s * 1000), window_end_ms=window_end_ms)
    out["capacity_tasks_per_s"] = round(capacity, 2)
    return out


def run_zipf(base: Settings, redis_url: str, spec: ZipfSpec, *, log_dir: str, redis_note: str = "",
             progress: Progress = lambda _: None) -> dict[str, Any]:
    started = time.monotonic()
    runs = []
    for k in range(spec.runs):
        progress(f"== run {k + 1} of {spec.runs}")
        seed = spec.seed + k
        scale = run_scenario(base, redis_url, spec, spec.tenants, seed, log_dir=log_dir, progress=progress)
        baseline = run_scenario(base, redis_url, spec, spec.baseline_tenants, seed, log_dir=log_dir,
                                progress=progress)
        runs.append({"scale": scale, "baseline": baseline})
    result = {"config": {**asdict(spec), "redis": redis_note or redis_url,
                         "capacity_tasks_per_s": runs[0]["scale"]["capacity_tasks_per_s"], "load_shape": asdict(LOAD)},
              "runs": runs, "runtime_s": round(time.monotonic() - started, 1)}
    return report.evaluate(result)


def spec_from_args(args: argparse.Namespace) -> ZipfSpec:
    spec = ZipfSpec(**(QUICK if args.quick else {}))
    given = {k: v for k, v in (("tenants", args.tenants), ("baseline_tenants", args.baseline_tenants),
                               ("duration_s", args.duration), ("runs", args.runs), ("load", args.load),
                               ("tpm", args.tpm), ("concurrency", args.concurrency)) if v is not None}
    spec = replace(spec, **given)
    if min(spec.tenants, spec.baseline_tenants, spec.runs, spec.tpm, spec.concurrency) < 1 \
            or spec.duration_s <= 0 or spec.load <= 0:
        raise ConfigError("--tenants, --baseline-tenants, --runs, --tpm, --concurrency, --duration and --load "
                          "must be positive")
    return spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenants", type=int, default=None,
                        help=f"zipf: tenants of the scale scenario (default {ZipfSpec.tenants})")
    parser.add_argument("--baseline-tenants", type=int, default=None,
                        help=f"zipf: tenants of the baseline (default {ZipfSpec.baseline_tenants})")
    parser.add_argument("--duration", type=float, default=None,
                        help=f"zipf: seconds of arrivals per scenario (default {ZipfSpec.duration_s:g}, "
                             f"--quick {QUICK['duration_s']:g})")
    parser.add_argument("--runs", type=int, default=None,
                        help=f"zipf: runs, for the spread (default {ZipfSpec.runs}, --quick {QUICK['runs']})")
    parser.add_argument("--load", type=float, default=None,
                        help=f"zipf: offered load / the pool's capacity (default {ZipfSpec.load:g})")


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    return run_on_bench_redis(args, "bench-fairness", lambda base, url, **kw: run_zipf(base, url, spec, **kw),
                              report.format_report)
