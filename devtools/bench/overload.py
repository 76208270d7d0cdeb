"""`gateway-dev bench-overload`: the load levels, through real Celery workers.

All three tiers offer load through the real producer (``Gateway.submit``) to one
gateway worker and the upstream simulator: first ``overload_factor`` (3x) the
pool's TPM for ``overload_s``, then ``recovery_factor`` (0.5x) for
``recovery_s``.  Offered load is counted in the tokens each request would use
undegraded (prompt + the simulator's completion of its max_tokens); the tiers
offer 15 / 35 / 50 % of it (vip / normal / batch), normal and batch asking for
``gpt-4o`` with a large max_tokens, so L1/L2 caps and the model fallback show.
The controller runs with the deployment's default settings (hold 30 s).

Printed per tier: submitted, completed, deferred (held by the load level, with the
reasons), failed, degraded, p99 queue wait; the deferral section: deferred, later run
(released and completed), lost (never ended; target 0); then the upstream's 429s and the
level timeline, and
the issue's targets: vip served >= 99.9 % with p99 wait < 50 ms, upstream 429s
<= 0.1 % of calls, the level back at L0 within 2 hold times after the load
drops, no request lost (every submitted one -- deferred ones included -- completed or
failed with a reason).

    python -m devtools.bench.overload [--quick] [--json] [--check]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import redis

from gateway_tasks.core.errors import ConfigError, GatewayError
from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.state import read_history, read_level
from gateway_tasks.core.settings import Pool, Settings
from devtools import processes
from devtools.bench import command as bench_command
from devtools.bench import overload_report
from devtools.bench.main import run_on_bench_redis
from devtools.bench.results import result_metas
from devtools.bench.load import end_run
from gateway_tasks.simulator import SimConfig, SimulatorProcess
from gateway_tasks.producer.gateway import Gateway

Progress = Callable[[str], None]
MODELS = ("gpt-4o", "gpt-4o-mini")


@dataclass(frozen=True)
class TierMix:
    tier: str
    share: float          # of the offered tokens
    prompt: str
    model: str
    max_tokens: int


MIX = (
    TierMix("vip", 0.15, "VIP question {i}: what is the status of order 4411 right now?", "gpt-4o", 200),
    TierMix("normal", 0.35, "Normal request {i}: draft a reply to this customer email about a delayed "
                            "delivery, polite and complete.", "gpt-4o", 3000),
    TierMix("batch", 0.50, "Batch job {i}: summarise document {i} in detail, every section, the "
                           "arguments, the evidence and the action items.", "gpt-4o", 3000),
)


@dataclass(frozen=True)
class OverloadSpec:
    tpm: int = 300_000              # 5k tokens/s
    rpm: int = 60_000               # far above the request rate: TPM binds
    burst_s: float = 2.0
    base_latency_ms: float = 40.0
    ms_per_output_token: float = 0.05
    completion_fraction: float = 0.6
    concurrency: int = 32
    tenants_per_tier: int = 4
    overload_factor: float = 3.0
    overload_s: float = 60.0
    recovery_factor: float = 0.5
    recovery_s: float = 75.0
    drain_timeout_s: float = 90.0    # after the load: every task must have ended by then


QUICK = {"overload_s": 25.0, "recovery_s": 65.0}


def request_tokens(gw: Gateway, mix: TierMix, spec: OverloadSpec) -> float:
    """Tokens one undegraded request of the tier uses (prompt + simulated completion)."""
    prompt = gw.estimate(f"bench-{mix.tier}-0", mix.prompt.format(i=0), model=mix.model,
                         max_tokens=mix.max_tokens, level=0).prompt_tokens
    return prompt + max(1, int(mix.max_tokens * spec.completion_fraction + 0.999))


class Offered:
    """Submits each tier's share of a token rate, on a schedule, and records every outcome."""

    def __init__(self, gw: Gateway, spec: OverloadSpec, sizes: dict[str, float]):
        self.gw, self.spec, self.sizes = gw, spec, sizes
        self.ids: dict[str, list[str]] = {m.tier: [] for m in MIX}
        self.deferred: dict[str, dict[str, int]] = {m.tier: {} for m in MIX}
        self.deferred_retry_s: dict[str, set[float]] = {m.tier: set() for m in MIX}
        self.deferred_ids: dict[str, list[str]] = {m.tier: [] for m in MIX}   # held, run later
        self.refused: dict[str, dict[str, int]] = {m.tier: {} for m in MIX}
        self.count = {m.tier: 0 for m in MIX}

    def submit(self, mix: TierMix) -> None:
        i = self.count[mix.tier]
        self.count[mix.tier] += 1
        tenant = f"bench-{mix.tier}-{i % self.spec.tenants_per_tier}"
        try:
            h = self.gw.submit(tenant, mix.prompt.format(i=i), model=mix.model, max_tokens=mix.max_tokens,
                               source="bench")
        except GatewayError as exc:
            name = type(exc).__name__
            self.refused[mix.tier][name] = self.refused[mix.tier].get(name, 0) + 1
            return
        self.ids[mix.tier].append(h.id)
        if h.deferral is not None:        # accepted and held: released later
            d = h.deferral
            key = f"L{d.level} {d.reason}: held up to {d.retry_after_s:g} s"
            self.deferred[mix.tier][key] = self.deferred[mix.tier].get(key, 0) + 1
            self.deferred_retry_s[mix.tier].add(d.retry_after_s)
            self.deferred_ids[mix.tier].append(h.id)

    def phase(self, factor: float, seconds: float, on_tick: Callable[[], None]) -> None:
        """Offer factor x TPM for seconds: each tier its share, evenly spaced."""
        rate = factor * self.spec.tpm / 60.0
        interval = {m.tier: self.sizes[m.tier] / (rate * m.share) for m in MIX}
        start = time.monotonic()
        nxt = {m.tier: start for m in MIX}
        next_tick = start
        while True:
            now = time.monotonic()
            if now - start >= seconds:
                return
            for m in MIX:
                while nxt[m.tier] <= now:
                    self.submit(m)
                    nxt[m.tier] += interval[m.tier]
            if now >= next_tick:
                on_tick()
                next_tick += 1.0
            time.sleep(max(0.0, min(min(nxt.values()), next_tick) - time.monotonic()))


def run_overload(base: Settings, redis_url: str, spec: OverloadSpec, *, log_dir: str,
                 redis_note: str = "", progress: Progress = lambda _: None) -> dict[str, Any]:
    started = time.monotonic()
    prefix = f"gt-bench-overload-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(redis_url)
    worker = gw = None
    timeline: list[tuple[float, int]] = []
    try:
        sim_cfg = SimConfig(tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s,
                            base_latency_ms=spec.base_latency_ms, ms_per_output_token=spec.ms_per_output_token,
                            completion_fraction=spec.completion_fraction, models=MODELS)
        with SimulatorProcess(sim_cfg) as sim:
            pool = Pool("default", base_url=sim.base_url, api_key="sk-bench", models=MODELS,
                        tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s)
            settings = base.with_(redis_url=redis_url, key_prefix=prefix, pools=(pool,))
            gw = Gateway(settings, client=client)
            for m in MIX:
                for k in range(spec.tenants_per_tier):
                    gw.register_tenant(f"bench-{m.tier}-{k}", m.tier)
            sizes = {m.tier: request_tokens(gw, m, spec) for m in MIX}
            worker = processes.worker(settings, concurrency=spec.concurrency, name="bench-overload",
                                      log_path=os.path.join(log_dir, "worker-overload.log")).start()
            processes.wait_for_workers(gw.app, 1, timeout_s=60.0)
            sim.reset_stats()
            keys = Keys(prefix)
            t0 = time.monotonic()

            def tick() -> None:
                timeline.append((round(time.monotonic() - t0, 1), read_level(client, keys)))

            load = Offered(gw, spec, sizes)
            progress(f"  {spec.overload_factor:g}x TPM for {spec.overload_s:g} s "
                     f"({spec.overload_factor * spec.tpm / 60:.0f} tokens/s offered)")
            load.phase(spec.overload_factor, spec.overload_s, tick)
            drop_s = time.monotonic() - t0
            progress(f"  {spec.recovery_factor:g}x TPM for {spec.recovery_s:g} s")
            load.phase(spec.recovery_factor, spec.recovery_s, tick)
            end_s = time.monotonic() - t0
            every = [t for ids in load.ids.values() for t in ids]
            progress(f"  load over; waiting for {len(every)} tasks to end")
            deadline = time.monotonic() + spec.drain_timeout_s
            keys_of = {t: gw.app.backend.get_key_for_task(t) for t in every}
            while time.monotonic() < deadline:
                tick()
                if len(result_metas(client, list(keys_of.values()))) >= len(every):
                    break
                time.sleep(1.0)
            upstream = sim.stats()
            history = read_history(client, keys, 500)
            wall_ms = time.time() * 1000.0
            mono_now = time.monotonic() - t0
            metas, held_metas = {}, {}
            for tier, ids in load.ids.items():
                metas[tier] = result_metas(client, [keys_of[t] for t in ids])
                held_metas[tier] = result_metas(client, [keys_of[t] for t in load.deferred_ids[tier]])
            worker.stop()
            worker = None
    finally:
        end_run(client, prefix, worker=worker, gw=gw)
    # history timestamps are Redis ms; put them on the run's clock
    offset_ms = wall_ms - mono_now * 1000.0
    changes = [{"t_s": round((h["ts_ms"] - offset_ms) / 1000.0, 1), "from": h["from"], "to": h["to"],
                "reason": h["reason"]} for h in history]
    result = {
        "config": {**asdict(spec), "redis": redis_note or redis_url, "prefix": prefix,
                   "hold_s": base.overload.hold_s, "window_s": base.overload.window_s,
                   "mix": [asdict(m) for m in MIX], "request_tokens": sizes},
        "tiers": {m.tier: overload_report.tier_row(m.tier, len(load.ids[m.tier]), load.deferred[m.tier],
                                                   sorted(load.deferred_retry_s[m.tier]),
                                                   load.refused[m.tier], metas[m.tier],
                                                   deferral=overload_report.deferral_row(
                                                       len(load.deferred_ids[m.tier]), held_metas[m.tier]))
                  for m in MIX},
        "upstream": {k: upstream[k] for k in ("requests_ok", "requests_429", "requests_error")},
        "drop_s": round(drop_s, 1), "end_s": round(end_s, 1),
        "level_changes": changes,
        "timeline": timeline,
        "runtime_s": round(time.monotonic() - started, 1),
    }
    return overload_report.evaluate(result)


def spec_from_args(args: argparse.Namespace) -> OverloadSpec:
    spec = OverloadSpec(tpm=args.tpm, concurrency=args.concurrency)
    if args.quick:
        spec = replace(spec, **QUICK)
    if args.overload_s is not None:
        spec = replace(spec, overload_s=args.overload_s)
    if args.recovery_s is not None:
        spec = replace(spec, recovery_s=args.recovery_s)
    if spec.tpm < 1 or spec.concurrency < 1 or spec.overload_s <= 0 or spec.recovery_s <= 0:
        raise ConfigError("--tpm, --concurrency, --overload-s and --recovery-s must be positive")
    return spec


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    return run_on_bench_redis(args, "bench-overload", lambda base, url, **kw: run_overload(base, url, spec, **kw),
                              overload_report.format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tpm", type=int, default=OverloadSpec.tpm,
                        help="the pool's and the simulator's TPM (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=OverloadSpec.concurrency,
                        help="worker threads (default %(default)s)")
    parser.add_argument("--overload-s", type=float, default=None,
                        help=f"seconds at 3x TPM (default {OverloadSpec.overload_s:g}, "
                             f"--quick {QUICK['overload_s']:g})")
    parser.add_argument("--recovery-s", type=float, default=None,
                        help=f"seconds at 0.5x TPM afterwards (default {OverloadSpec.recovery_s:g})")
    bench_command.add_common_arguments(parser)


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-overload",
                           "overload benchmark: 3x TPM then 0.5x, per-tier outcomes, 429s, level timeline",
                           __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return bench_command.standalone("devtools.bench.overload", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
