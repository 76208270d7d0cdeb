"""`gateway-dev bench-fairness`: the noisy neighbour, through real Celery workers.

In one tier (``normal``), one tenant -- the flooder -- enqueues ``flood``
requests at once, while ``quiet_tenants`` other tenants of the same tier each
send one request every ``quiet_interval_s`` (together ~30 % of the pool's TPM),
until the flooder's last request is dispatched.  Everything goes through the
real producer (``Gateway.submit``) to one gateway worker (threads) and the
upstream simulator.  Tenant fair queuing should hand every quiet request the
next slot the bucket allows (queue-wait p99 < 1 s), and the flooder everything
else (the pool >= 95 % utilised during the flood).

    python -m devtools.bench.fairness [--quick] [--json] [--check]

``--scenario zipf``: latency fairness at scale, 10,000 tenants of Zipf demand beside a
10-tenant baseline (devtools/bench/fairness_zipf.py).

Where each number comes from: queue waits and tokens per tenant from each
task's result (``timing.queue_wait_ms`` = dispatched_ms - enqueued_ms, Redis
TIME; ``tokens.total``, what the upstream reported); utilisation from the
simulator's ``/stats`` at the two ends of the flood window (quota really used:
``bench.utilisation``).  Redis: the settings' REDIS_URL, else an embedded
redis-server; the run's key prefix is deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

import redis

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.dispatch.index_entry import tenant_range
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, Settings
from devtools.quotas import for_load
from devtools import processes
from devtools.bench import command as bench_command
from devtools.bench import fairness_report, fairness_zipf
from devtools.bench.load import end_run, TierLoad, count_results, read_results, served_in_window
from devtools.bench.main import run_on_bench_redis
from devtools.bench.utilisation import UpstreamPoint, window_utilisation
from gateway_tasks.simulator import SimConfig, SimulatorProcess
from gateway_tasks.producer.gateway import Gateway

MODEL = "gpt-4o-mini"
Progress = Callable[[str], None]
FLOODER_LOAD = TierLoad("Flood request {i}: summarise this support ticket and suggest a reply "
                        "the agent could send.", 220, 200)
QUIET_LOAD = TierLoad("Quiet request {i}: draft a short reply to this customer email about a "
                      "delayed delivery, keep it polite.", 300, 270)
POLL_S = 0.1          # how often the run checks the flooder's queue between quiet requests
SIM_SECOND_CLOSE_S = 1.05   # the simulator's per-second series closes its current second


@dataclass(frozen=True)
class FairnessSpec:
    """The scenario.  With the defaults the flood lasts ~65 s: 400 x ~230 tokens
    at the 70 % of 2000 tokens/s the quiet tenants leave."""

    tpm: int = 120_000
    rpm: int = 60_000              # far above the request rate: TPM binds
    burst_s: float = 2.0
    base_latency_ms: float = 100.0
    ms_per_output_token: float = 1.0
    concurrency: int = 16
    tier: str = "normal"
    flood_requests: int = 400
    quiet_tenants: int = 4
    quiet_interval_s: float = 2.0  # per quiet tenant; the tenants are staggered evenly
    timeout_s: float = 300.0       # the flood may last at most this long
    grace_s: float = 10.0          # after the flood: wait this long at most for results

    @property
    def tokens_per_s(self) -> float:
        return self.tpm / 60.0

    def quiet_share_pct(self, tokens_per_request: float) -> float:
        """The quiet tenants' part of the TPM, for requests of this many tokens."""
        per_s = self.quiet_tenants / self.quiet_interval_s * tokens_per_request
        return 100.0 * per_s / self.tokens_per_s


QUICK = {"flood_requests": 100}


def sim_config(spec: FairnessSpec) -> SimConfig:
    return SimConfig(tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s,
                     base_latency_ms=spec.base_latency_ms,
                     ms_per_output_token=spec.ms_per_output_token, models=(MODEL,))


def submit(gw: Gateway, tenant: str, load: TierLoad, i: int) -> str:
    handle = gw.submit(tenant, load.prompt.format(i=i), max_tokens=load.max_tokens, source="bench",
                       extra_body={"sim_completion_tokens": load.completion_tokens})
    return handle.id


def queued_of(client: redis.Redis, keys: Keys, pool: str, tier: str, tenant: str) -> int:
    """How many of one tenant's tasks are still queued (not dispatched)."""
    lo, hi = tenant_range(tenant)
    return int(client.zlexcount(keys.index(pool, tier), lo, hi))


def run_flood(gw: Gateway, client: redis.Redis, sim: Any, spec: FairnessSpec, pool: str,
              flooder: str, quiet: list[str]) -> tuple[dict[str, list[str]], UpstreamPoint,
                                                        UpstreamPoint]:
    """Enqueue the flood, then send quiet requests until the flooder's queue is empty;
    returns the task ids per tenant and the upstream at the flood window's ends."""
    ids: dict[str, list[str]] = {t: [] for t in [flooder, *quiet]}
    ids[flooder] = [submit(gw, flooder, FLOODER_LOAD, i) for i in range(spec.flood_requests)]
    start = UpstreamPoint.from_stats(sim.stats())   # the flood is queued: the window opens
    step_s = spec.quiet_interval_s / len(quiet)
    t0 = time.monotonic()
    deadline = t0 + spec.timeout_s
    n = 0
    while time.monotonic() < deadline:
        tenant = quiet[n % len(quiet)]
        ids[tenant].append(submit(gw, tenant, QUIET_LOAD, n))
        n += 1
        next_at = t0 + n * step_s
        while time.monotonic() < min(next_at, deadline):
            if queued_of(client, gw.keys, pool, spec.tier, flooder) == 0:
                return ids, start, UpstreamPoint.from_stats(sim.stats())
            time.sleep(min(POLL_S, max(0.0, next_at - time.monotonic())))
    return ids, start, UpstreamPoint.from_stats(sim.stats())


def wait_for_all(gw: Gateway, client: redis.Redis, task_ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and count_results(client, gw.app, task_ids) < len(task_ids):
        time.sleep(0.2)


def run_fairness(base: Settings, redis_url: str, spec: FairnessSpec, *, log_dir: str,
                 redis_note: str = "", progress: Progress = lambda _: None) -> dict[str, Any]:
    """The scenario on a fresh key prefix; the result is JSON-able (see fairness_report)."""
    started = time.monotonic()
    prefix = f"gt-bench-fair-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(redis_url)
    worker = None
    gw = None
    try:
        with SimulatorProcess(sim_config(spec)) as sim:
            pool = Pool("default", base_url=sim.base_url, api_key="sk-bench", models=(MODEL,),
                        tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s)
            settings = for_load(base.with_(redis_url=redis_url, key_prefix=prefix, pools=(pool,)))
            gw = Gateway(settings, client=client)
            flooder = "flood-0"
            quiet = [f"quiet-{k + 1}" for k in range(spec.quiet_tenants)]
            for tenant in (flooder, *quiet):
                gw.register_tenant(tenant, spec.tier)
            quiet_tokens = gw.estimate(quiet[0], QUIET_LOAD.prompt.format(i=0)).prompt_tokens \
                + QUIET_LOAD.completion_tokens
            worker = processes.worker(settings, concurrency=spec.concurrency, name="bench-fair",
                                      log_path=os.path.join(log_dir, "worker-fairness.log")).start()
            processes.wait_for_workers(gw.app, 1, timeout_s=60.0)
            sim.reset_stats()
            progress(f"  flooding: {spec.flood_requests} requests of {flooder}, "
                     f"{len(quiet)} quiet tenants every {spec.quiet_interval_s:g} s")
            ids, w0, w1 = run_flood(gw, client, sim, spec, pool.name, flooder, quiet)
            progress(f"  flood over after {w1.monotonic_s - w0.monotonic_s:.1f} s; collecting results")
            wait_for_all(gw, client, [t for v in ids.values() for t in v], spec.grace_s)
            time.sleep(SIM_SECOND_CLOSE_S)
            upstream = sim.stats()
            worker.stop()
            worker = None
            results = {t: read_results(client, gw.app, v) for t, v in ids.items()}
    finally:
        end_run(client, prefix, worker=worker, gw=gw)

    window = window_utilisation(w0, w1, spec.tokens_per_s)
    rows = [fairness_report.tenant_row(t, fairness_report.FLOODER if t == flooder
                                       else fairness_report.QUIET, len(ids[t]), results[t],
                                       window["window_s"])
            for t in ids]
    result = {
        "config": {**asdict(spec), "redis": redis_note or redis_url, "prefix": prefix,
                   "quiet_share_pct": round(spec.quiet_share_pct(quiet_tokens), 1),
                   "loads": {"flooder": asdict(FLOODER_LOAD), "quiet": asdict(QUIET_LOAD)}},
        "tenants": rows,
        "flood_window": window,
        "flood_window_naive": served_in_window(upstream, w0.monotonic_s, w1.monotonic_s,
                                               spec.tokens_per_s),
        "upstream": {k: upstream[k] for k in ("requests_ok", "requests_429", "requests_error")},
        "runtime_s": round(time.monotonic() - started, 1),
    }
    return fairness_report.evaluate(result)


def spec_from_args(args: argparse.Namespace) -> FairnessSpec:
    flood = args.flood if args.flood is not None else (
        QUICK["flood_requests"] if args.quick else FairnessSpec.flood_requests)
    spec = FairnessSpec(tpm=args.tpm, flood_requests=flood, concurrency=args.concurrency)
    if spec.flood_requests < 1 or spec.tpm < 1 or spec.concurrency < 1:
        raise ConfigError("--flood, --tpm and --concurrency must be positive")
    return spec


def run(args: argparse.Namespace) -> int:
    if args.scenario == "zipf":
        return fairness_zipf.run(args)
    spec = spec_from_args(args)
    return run_on_bench_redis(args, "bench-fairness", lambda base, url, **kw: run_fairness(base, url, spec, **kw),
                              fairness_report.format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=("noisy", "zipf"), default="noisy",
                        help="noisy: one flooder beside quiet tenants (this module); zipf: 10,000 tenants of "
                             "Zipf demand at 2x capacity beside a 10-tenant baseline, waits per quartile of ids "
                             "(devtools/bench/fairness_zipf.py)")
    parser.add_argument("--flood", type=int, default=None,
                        help=f"the flooder's requests (default {FairnessSpec.flood_requests}, "
                             f"--quick {QUICK['flood_requests']})")
    parser.add_argument("--tpm", type=int, default=FairnessSpec.tpm,
                        help="upstream tokens per minute (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=FairnessSpec.concurrency,
                        help="worker threads (default %(default)s)")
    fairness_zipf.add_arguments(parser)
    bench_command.add_common_arguments(parser)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-fairness", "noisy-neighbour benchmark: one tenant floods its tier, quiet tenants' waits and the pool's utilisation",
                           __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return bench_command.standalone("devtools.bench.fairness", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
