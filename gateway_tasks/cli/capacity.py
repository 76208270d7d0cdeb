"""`gateway capacity`: instances needed for a load, and the cron demand forecast.

    gateway capacity --baseline-qps 20 --peak-qps 120 --tokens-per-request 900 --instance-tps 5000
    gateway capacity --measure-s 30 [--peak-qps 120]     # rates measured in Redis now
    gateway capacity --tenants 30000 --tasks-per-tenant-per-hour 3 --peak-multiplier 2 \
        --inference-ms 800 --p99-target-ms 3000 [--jitter-window-s 300]   # the tenant model
    gateway capacity forecast [--horizon-s 600] [--bucket-s 60] [--json]

The model (gateway_tasks.capacity.model): instances = ceil(max(QPS x tokens per
request / instance tokens/s, QPS / instance requests/s) x safety factor 1.5).
With ``--measure-s S`` it samples the deployment's counters in Redis every
second for S seconds: baseline QPS = completed calls/s over the window, peak
QPS = the busiest second, tokens per request = upstream-reported tokens per
call, and a worker's throughput by Little's law = its thread count (Celery
``inspect stats``) / the mean upstream latency.  Flags given explicitly win
over measured values.

With ``--tenants`` it runs the tenant model instead (gateway_tasks.capacity.model:
baseline and peak QPS from tenants, tasks per tenant per hour, the jitter window
and the peak multiplier; instances = int(peak QPS / (1000 / inference ms) x
safety factor) + 1, without jitter and with the window).  ``--measure-s`` then
fills ``--inference-ms`` from the measured mean upstream latency when it is not
given.

    gateway capacity --from-deployment --p99-target-ms 3000 [--tenants N ...]

runs the tenant model on the running deployment's own figures (any flag given
wins): tenants = the tenants registered; tasks per tenant per hour = requests
enqueued in the last 60 minutes (the demand history) / tenants; inference ms =
the mean upstream latency of every completed call (or of the ``--measure-s``
window); peak multiplier = from the last 7 days of demand, the busiest minute's
rate over its hour's requests spread evenly over the jitter window
(gateway_tasks.capacity.history.peak_multiplier).  The p99 target is a target,
not a measurement: it is always given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import redis

from gateway_tasks.core.redis_client import Client, data_client
from gateway_tasks.capacity.model import (DEFAULT_JITTER_WINDOW_S, DEFAULT_SAFETY_FACTOR, NO_JITTER_WINDOW_S,
                                          CapacityPlan, Instance, TenantLoad, TenantPlan,
                                          instance_rps_from_concurrency, plan, tenant_plan)
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.capacity.forecast import Forecast
from gateway_tasks.capacity.history import (HISTORY_DAYS, LEAD_FROM_MIN, LEAD_TO_MIN, MINUTES_PER_DAY,
                                            DemandForecast, cells_of, minute_of, peak_multiplier,
                                            read_forecast, read_minutes)
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings, get_settings
from gateway_tasks.core.stats import ACTUAL_TOKENS, COMPLETED, UPSTREAM_MS, tier_field

from beat.forecast import DEFAULT_BUCKET_S, DEFAULT_HORIZON_S, compute_forecast, read_published
from beat.schedule import iso_utc


# -- measuring -------------------------------------------------------------------
@dataclass(frozen=True)
class Counters:
    """Completed calls, their tokens and upstream time, summed over pools and tiers."""

    completed: float
    tokens: float
    upstream_ms: float


def read_counters(client: redis.Redis, settings: Settings) -> Counters:
    keys = Keys(settings.key_prefix)
    fields = [(c, t.name) for c in (COMPLETED, ACTUAL_TOKENS, UPSTREAM_MS) for t in settings.tiers]
    with client.pipeline(transaction=False) as pipe:
        for pool in settings.pools:
            pipe.hmget(keys.stats(pool.name), [tier_field(c, t) for c, t in fields])
        replies = pipe.execute()
    sums = {COMPLETED: 0.0, ACTUAL_TOKENS: 0.0, UPSTREAM_MS: 0.0}
    for reply in replies:
        for (counter, _), value in zip(fields, reply):
            sums[counter] += float(value or 0)
    return Counters(sums[COMPLETED], sums[ACTUAL_TOKENS], sums[UPSTREAM_MS])


@dataclass(frozen=True)
class Measured:
    window_s: float
    baseline_qps: float
    peak_qps: float
    tokens_per_request: float | None
    latency_s: float | None
    workers: int
    concurrency: float | None          # threads per worker (mean)


def rates(samples: list[tuple[float, Counters]]) -> tuple[float, float, float | None, float | None]:
    """(mean QPS, busiest-interval QPS, tokens per call, mean latency s) of counter samples
    taken at the given monotonic times (pure)."""
    if len(samples) < 2:
        raise ConfigError("capacity: at least two samples are needed to measure a rate")
    (t0, first), (t1, last) = samples[0], samples[-1]
    span = t1 - t0
    if span <= 0:
        raise ConfigError("capacity: the samples span no time")
    done = last.completed - first.completed
    peak = max((b.completed - a.completed) / (tb - ta)
               for (ta, a), (tb, b) in zip(samples, samples[1:]) if tb > ta)
    tpr = (last.tokens - first.tokens) / done if done > 0 else None
    lat = (last.upstream_ms - first.upstream_ms) / done / 1000.0 if done > 0 else None
    return done / span, peak, tpr, (lat if lat and lat > 0 else None)


def worker_concurrency(settings: Settings) -> tuple[int, float | None]:
    """(workers answering, their mean thread count) from Celery ``inspect stats``."""
    from gateway_tasks.core.celery_app import make_app

    app = make_app(settings)
    try:
        stats = app.control.inspect(timeout=1.0).stats() or {}
    finally:
        app.close()
    threads = [float((s.get("pool") or {}).get("max-concurrency") or 0) for s in stats.values()]
    threads = [t for t in threads if t > 0]
    return len(stats), (sum(threads) / len(threads) if threads else None)


def measure(client: redis.Redis, settings: Settings, window_s: float,
            sleep: Callable[[float], None] = time.sleep,
            clock: Callable[[], float] = time.monotonic) -> Measured:
    """Sample the counters about every second for ``window_s`` seconds."""
    samples = [(clock(), read_counters(client, settings))]
    end = samples[0][0] + window_s
    while samples[-1][0] < end:
        sleep(min(1.0, max(0.0, end - clock())))
        samples.append((clock(), read_counters(client, settings)))
    base, peak, tpr, lat = rates(samples)
    workers, concurrency = worker_concurrency(settings)
    return Measured(window_s, base, peak, tpr, lat, workers, concurrency)


@dataclass(frozen=True)
class Deployed:
    """The tenant model's inputs as the running deployment shows them (None: no data)."""

    tenants: int
    requests_last_hour: float               # enqueued in the last 60 whole minutes
    completed: float                        # upstream calls completed, ever
    inference_ms: float | None              # their mean upstream latency
    peak_multiplier: float | None           # from the last 7 days' demand
    jitter_window_s: float

    @property
    def tasks_per_tenant_per_hour(self) -> float | None:
        return self.requests_last_hour / self.tenants if self.tenants and self.requests_last_hour else None


def read_deployed(client: redis.Redis, settings: Settings, now_ms: int, jitter_window_s: float) -> Deployed:
    """Registered tenants, the demand history and the upstream latency counters (three
    pipelines: the tenants and counters, the last hour, the last 7 days)."""
    keys = Keys(settings.key_prefix)
    cells = cells_of((p.name for p in settings.pools), (t.name for t in settings.tiers))
    tenants = int(client.scard(keys.tenants))
    counters = read_counters(client, settings)
    now_min = minute_of(now_ms)
    last_hour = sum(read_minutes(client, keys, cells, now_min - 60, 60))
    first = now_min - HISTORY_DAYS * MINUTES_PER_DAY
    first -= first % 60                                 # whole clock hours
    week = read_minutes(client, keys, cells, first, now_min - first)
    latency = counters.upstream_ms / counters.completed if counters.completed else None
    return Deployed(tenants, last_hour, counters.completed, latency or None,
                    peak_multiplier(week, jitter_window_s), jitter_window_s)


# -- planning --------------------------------------------------------------------
def instance_of(args: argparse.Namespace, measured: Measured | None) -> Instance:
    rps = args.instance_rps
    if rps is None and args.instance_concurrency is not None and args.latency_s is not None:
        rps = instance_rps_from_concurrency(args.instance_concurrency, args.latency_s)
    if rps is None and args.instance_tps is None and measured is not None:
        concurrency = args.instance_concurrency or measured.concurrency
        latency = args.latency_s or measured.latency_s
        if concurrency and latency:
            rps = instance_rps_from_concurrency(concurrency, latency)
    if rps is None and args.instance_tps is None:
        raise ConfigError("capacity: give the per-instance throughput: --instance-tps, --instance-rps, "
                          "or --instance-concurrency with --latency-s (or --measure-s on a running "
                          "deployment with completed calls)")
    return Instance(tokens_per_s=args.instance_tps, requests_per_s=rps)


def plan_from_args(args: argparse.Namespace, settings: Settings,
                   measured: Measured | None = None) -> CapacityPlan:
    def pick(name: str, measured_value: float | None) -> float:
        value = getattr(args, name)
        if value is None:
            value = measured_value
        if value is None:
            raise ConfigError(f"capacity: --{name.replace('_', '-')} is required "
                              "(or measure it: --measure-s 30 on a running deployment)")
        return value

    m = measured
    baseline = pick("baseline_qps", m.baseline_qps if m else None)
    peak = pick("peak_qps", max(m.peak_qps, baseline) if m else None)
    tpr = pick("tokens_per_request", m.tokens_per_request if m else None)
    upstream = args.upstream_tpm if args.upstream_tpm is not None else \
        float(sum(p.tpm for p in settings.pools))
    return plan(baseline, peak, tpr, instance_of(args, m), args.safety_factor, upstream)


def format_plan(p: CapacityPlan, measured: Measured | None) -> str:
    lines = []
    if measured is not None:
        lines.append(f"measured over {measured.window_s:g} s: {measured.baseline_qps:.2f} req/s mean, "
                     f"{measured.peak_qps:.2f} req/s busiest second, "
                     + (f"{measured.tokens_per_request:.0f} tokens/request, "
                        if measured.tokens_per_request else "no completed calls, ")
                     + (f"upstream latency {measured.latency_s * 1000:.0f} ms, " if measured.latency_s else "")
                     + f"{measured.workers} worker(s)"
                     + (f" x {measured.concurrency:g} threads" if measured.concurrency else ""))
    inst = []
    if p.instance.tokens_per_s is not None:
        inst.append(f"{p.instance.tokens_per_s:g} tokens/s")
    if p.instance.requests_per_s is not None:
        inst.append(f"{p.instance.requests_per_s:.3g} requests/s")
    lines.append(f"per instance: {' and '.join(inst)}; {p.tokens_per_request:g} tokens/request; "
                 f"safety factor {p.safety_factor:g}")
    lines.append(f"{'load':<9} {'req/s':>10} {'tokens/s':>12} {'TPM':>14} {'raw':>8} {'instances':>10}")
    for ln in (p.baseline, p.peak):
        lines.append(f"{ln.name:<9} {ln.qps:>10.2f} {ln.tokens_per_s:>12.0f} {ln.tokens_per_minute:>14.0f} "
                     f"{ln.raw_instances:>8.2f} {ln.instances:>10d}")
    ratio = f"{p.peak_over_baseline:.2f}x" if p.peak_over_baseline else "-"
    lines.append(f"peak/baseline {ratio}; warm pool (min replicas) {p.warm_pool}, max replicas "
                 f"{p.max_replicas}")
    if p.upstream_tpm_available is not None:
        verdict = "enough" if p.upstream_ok else "NOT enough: raise the quota or add a pool"
        lines.append(f"upstream quota: peak needs {p.upstream_tpm_needed:.0f} TPM with the factor, "
                     f"pools have {p.upstream_tpm_available:.0f} TPM: {verdict}")
    return "\n".join(lines)


# -- the tenant model ------------------------------------------------------------
QPS_MODE_FLAGS = ("baseline_qps", "peak_qps", "tokens_per_request", "instance_tps", "instance_rps",
                  "instance_concurrency", "latency_s", "upstream_tpm")
TENANT_FLAGS = ("tasks_per_tenant_per_hour", "peak_multiplier", "inference_ms", "p99_target_ms",
                "jitter_window_s")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def tenant_mode(args: argparse.Namespace) -> bool:
    """Whether the command runs the tenant model (``--tenants`` or ``--from-deployment``
    given); ConfigError when its flags are mixed with the QPS model's."""
    deployed = bool(getattr(args, "from_deployment", False))
    tenant = [n for n in ("tenants",) + TENANT_FLAGS if getattr(args, n, None) is not None]
    if not tenant and not deployed:
        return False
    if getattr(args, "tenants", None) is None and not deployed:
        raise ConfigError(f"capacity: {', '.join(_flag(n) for n in tenant)} belong to the tenant "
                          "model: give --tenants too")
    mixed = [_flag(n) for n in QPS_MODE_FLAGS if getattr(args, n, None) is not None]
    if mixed:
        raise ConfigError(f"capacity: {', '.join(mixed)} belong to the QPS model, not the tenant "
                          "model (--tenants, --from-deployment)")
    return True


def jitter_window_of(args: argparse.Namespace) -> float:
    return args.jitter_window_s if args.jitter_window_s is not None else DEFAULT_JITTER_WINDOW_S


def tenant_load_from_args(args: argparse.Namespace, measured: Measured | None = None,
                          deployed: Deployed | None = None) -> TenantLoad:
    """The tenant model's inputs from the flags, else from the deployment (``deployed``);
    the inference time from the measured mean upstream latency (``--measure-s``) before
    the all-time one."""
    def need(name: str, value: float | None, found: float | None = None, what: str = "") -> float:
        if value is None:
            value = found
        if value is None:
            where = f"--from-deployment ({what})" if deployed is not None else "--tenants"
            raise ConfigError(f"capacity: {_flag(name)} is required with {where}")
        return value

    inference_ms = args.inference_ms
    if inference_ms is None and measured is not None and measured.latency_s:
        inference_ms = measured.latency_s * 1000.0
    if inference_ms is None and deployed is not None:
        inference_ms = deployed.inference_ms
    if inference_ms is None and deployed is not None:
        raise ConfigError("capacity: --inference-ms is required with --from-deployment (no upstream "
                          "call has completed yet)")
    if inference_ms is None:
        raise ConfigError("capacity: --inference-ms is required with --tenants (or measure it: "
                          "--measure-s 30 on a running deployment with completed calls)")
    d = deployed
    return TenantLoad(
        tenants=need("tenants", args.tenants, (d.tenants or None) if d else None, "no tenant is registered"),
        tasks_per_tenant_per_hour=need("tasks_per_tenant_per_hour", args.tasks_per_tenant_per_hour,
                                       d.tasks_per_tenant_per_hour if d else None,
                                       "nothing was enqueued in the last 60 minutes"),
        peak_multiplier=need("peak_multiplier", args.peak_multiplier, d.peak_multiplier if d else None,
                             "no demand in the last 7 days"),
        inference_ms=inference_ms,
        p99_target_ms=need("p99_target_ms", args.p99_target_ms, None, "a target, not a measurement"),
        safety_factor=args.safety_factor,
        jitter_window_s=jitter_window_of(args))


def format_deployed(d: Deployed, load: TenantLoad, args: argparse.Namespace) -> str:
    """Where each input came from: a flag or the deployment."""
    def src(name: str, text: str) -> str:
        return "flag" if getattr(args, name) is not None else text

    infer = "--measure-s window" if args.inference_ms is None and args.measure_s else \
        src("inference_ms", f"mean upstream latency of {d.completed:.0f} completed calls")
    return (f"from the deployment: tenants {_number(load.tenants)} ({src('tenants', 'registered')}); "
            f"tasks/tenant/hour {_number(load.tasks_per_tenant_per_hour)} "
            f"({src('tasks_per_tenant_per_hour', f'{d.requests_last_hour:.0f} requests in the last 60 min')}); "
            f"inference {_number(load.inference_ms)} ms ({infer}); "
            f"peak multiplier {_number(load.peak_multiplier)} "
            f"({src('peak_multiplier', 'busiest minute of the last 7 days')})")


def _number(value: float) -> str:
    """A figure as printed: whole numbers without decimals, others to 2 places."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def format_tenant_plan(p: TenantPlan, measured: Measured | None = None) -> str:
    ld = p.load
    window = _number(ld.jitter_window_s)
    no_jitter = _number(NO_JITTER_WINDOW_S)
    source = " (measured mean upstream latency)" if measured is not None and measured.latency_s         and ld.inference_ms == measured.latency_s * 1000.0 else ""
    rows = [
        ("baseline QPS (hourly mean)", _number(p.baseline_qps), "requests/s"),
        (f"peak QPS, no jitter ({no_jitter} s window)", _number(p.peak_qps_no_jitter), "requests/s"),
        (f"peak QPS, {window} s jitter window", _number(p.peak_qps_jittered), "requests/s"),
        (f"instances, no jitter ({no_jitter} s window)", str(p.instances_no_jitter), "instances"),
        (f"instances, {window} s jitter window", str(p.instances_jittered), "instances"),
    ]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"tenant model: {_number(ld.tenants)} tenants x {_number(ld.tasks_per_tenant_per_hour)} "
             f"tasks/tenant/hour, peak multiplier {_number(ld.peak_multiplier)}, inference "
             f"{_number(ld.inference_ms)} ms{source} ({_number(p.instance_qps)} requests/s per instance), "
             f"safety factor {_number(ld.safety_factor)}"]
    lines += [f"{name + ':':<{width + 1}} {value:>10} {unit}" for name, value, unit in rows]
    verdict = "within it" if p.inference_within_p99_target else         "NOT within it: one inference alone exceeds the target"
    lines.append(f"p99 target {_number(ld.p99_target_ms)} ms: inference {_number(ld.inference_ms)} ms "
                 f"is {verdict}")
    return "\n".join(lines)


def _client(settings: Settings, who: str) -> Client:
    return data_client(settings, who)


def cmd_plan(args: argparse.Namespace) -> int:
    tenants = tenant_mode(args)
    from_deployment = bool(getattr(args, "from_deployment", False))
    # the tenant model from flags alone needs no deployment: settings are read only to
    # measure or to check the pools' quota
    settings = get_settings() if args.measure_s or from_deployment or not tenants else None
    measured = None
    if args.measure_s:
        if args.measure_s <= 0:
            raise ConfigError(f"capacity: --measure-s={args.measure_s!r} is invalid; expected > 0")
        assert settings is not None
        client = _client(settings, "`gateway capacity --measure-s`")
        try:
            measured = measure(client, settings, args.measure_s)
        finally:
            client.close()
    deployed = None
    if from_deployment:
        assert settings is not None
        client = _client(settings, "`gateway capacity --from-deployment`")
        try:
            sec, usec = client.time()
            deployed = read_deployed(client, settings, int(sec) * 1000 + int(usec) // 1000,
                                     jitter_window_of(args))
        finally:
            client.close()
    if tenants:
        load = tenant_load_from_args(args, measured, deployed)
        tp = tenant_plan(load)
        text = format_tenant_plan(tp, measured)
        doc = tp.as_dict()
        if deployed is not None:
            text = format_deployed(deployed, load, args) + "\n" + text
            doc = {**doc, "deployed": asdict(deployed)}
        _print_plan(doc, text, measured, as_json=args.json)
        return 0
    assert settings is not None
    p = plan_from_args(args, settings, measured)
    _print_plan(p.as_dict(), format_plan(p, measured), measured, as_json=args.json)
    return 0


def _print_plan(doc: dict[str, Any], text: str, measured: Any, *, as_json: bool) -> None:
    """A plan as JSON (with what was measured, if anything) or as its text."""
    if as_json:
        if measured is not None:
            doc = {**doc, "measured": asdict(measured)}
        print(json.dumps(doc, indent=2))
    else:
        print(text)


# -- forecast --------------------------------------------------------------------
def format_forecast(fc: Forecast, settings: Settings) -> str:
    if not fc.series:
        return (f"no cron runs in the next {fc.bucket_s * fc.buckets} s "
                f"({fc.entries_read} entries read)")
    head = f"{'pool':<12} {'tier':<8} " + " ".join(f"{'+' + str(i * fc.bucket_s) + 's':>9}"
                                                  for i in range(fc.buckets))
    lines = [f"cron demand from {iso_utc(fc.start_ms)} in {fc.bucket_s} s bins "
             "(estimated tokens; runs in brackets on the next line)", head]
    for (pool, tier), s in sorted(fc.series.items()):
        lines.append(f"{pool:<12} {tier:<8} " + " ".join(f"{t:>9d}" for t in s.tokens))
        lines.append(f"{'':<12} {'':<8} " + " ".join(f"{'(' + str(n) + ')':>9}" for n in s.runs))
    for pool in settings.pools:
        tokens = fc.pool_tokens(pool.name)
        per_min = max(tokens, default=0) * 60 / fc.bucket_s
        if per_min:
            lines.append(f"pool {pool.name}: busiest bin {per_min:.0f} tokens/min = "
                         f"{100 * per_min / pool.tpm:.0f}% of its {pool.tpm} TPM")
    return "\n".join(lines)


def format_demand(demand: list[DemandForecast]) -> str:
    """The demand forecast per pool and tier: history's P95, the schedule's, the larger."""
    lines = [f"demand forecast {LEAD_FROM_MIN}-{LEAD_TO_MIN} minutes ahead, per minute "
             "(history: P95 of the same time of day over the last 7 days; cron: the schedule's "
             "busiest minute; forecast: the larger)",
             f"{'pool':<12} {'tier':<8} {'history req':>12} {'cron req':>9} {'forecast req':>13} "
             f"{'history tok':>12} {'cron tok':>10} {'forecast tok':>13}"]
    for d in demand:
        lines.append(f"{d.pool:<12} {d.tier:<8} {d.history_requests:>12.1f} {d.cron_requests:>9.1f} "
                     f"{d.requests:>13.1f} {d.history_tokens:>12.0f} {d.cron_tokens:>10.0f} {d.tokens:>13.0f}")
    return "\n".join(lines)


def cmd_forecast(args: argparse.Namespace) -> int:
    settings = get_settings()
    client = _client(settings, "`gateway capacity forecast`")
    try:
        sec, usec = client.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        if args.published:
            fc = read_published(client, settings)
            if fc is None:
                raise ConfigError("no published forecast: is a beat running "
                                  "(celery -A beat.app beat)? Without --published it is computed now")
        else:
            fc = compute_forecast(client, settings, now_ms, args.horizon_s, args.bucket_s)
        cells = cells_of((p.name for p in settings.pools), (t.name for t in settings.tiers))
        demand = read_forecast(client, Keys(settings.key_prefix), cells, now_ms, fc)
    finally:
        client.close()
    if args.json:
        print(json.dumps({**json.loads(fc.to_json()), "demand": [d.as_dict() for d in demand]},
                         separators=(",", ":")))
    else:
        print(format_forecast(fc, settings))
        print(format_demand(demand))
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "capacity", help="instances needed for a load (flags or measured in Redis); cron demand forecast",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-qps", type=float, default=None, help="baseline requests/s")
    parser.add_argument("--peak-qps", type=float, default=None, help="peak requests/s")
    parser.add_argument("--tokens-per-request", type=float, default=None,
                        help="prompt + completion tokens of a request")
    parser.add_argument("--instance-tps", type=float, default=None, help="tokens/s one instance sustains")
    parser.add_argument("--instance-rps", type=float, default=None,
                        help="requests/s one instance sustains")
    parser.add_argument("--instance-concurrency", type=float, default=None,
                        help="concurrent calls per instance (worker threads, -c)")
    parser.add_argument("--latency-s", type=float, default=None, help="mean upstream call latency (s)")
    parser.add_argument("--safety-factor", type=float, default=DEFAULT_SAFETY_FACTOR,
                        help="headroom multiplier (default %(default)s)")
    parser.add_argument("--upstream-tpm", type=float, default=None,
                        help="upstream quota to check against (default: the pools' TPM summed)")
    tenants = parser.add_argument_group("the tenant model (--tenants)")
    tenants.add_argument("--tenants", type=float, default=None, help="number of tenants")
    tenants.add_argument("--tasks-per-tenant-per-hour", type=float, default=None,
                         help="scheduled tasks per tenant per hour")
    tenants.add_argument("--peak-multiplier", type=float, default=None, help="peak / mean ratio")
    tenants.add_argument("--inference-ms", type=float, default=None,
                         help="mean inference time of one request (ms; measured with --measure-s)")
    tenants.add_argument("--p99-target-ms", type=float, default=None, help="p99 latency target (ms)")
    tenants.add_argument("--jitter-window-s", type=float, default=None,
                         help=f"jitter window the tasks are spread over (s; default {DEFAULT_JITTER_WINDOW_S:g})")
    tenants.add_argument("--from-deployment", action="store_true",
                         help="the tenant model on the running deployment's figures: registered tenants, "
                              "the last hour's and 7 days' demand, the mean upstream latency (flags win)")
    parser.add_argument("--measure-s", type=float, default=0.0,
                        help="measure rates in the deployment's Redis for this many seconds")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=cmd_plan)
    sub = parser.add_subparsers(dest="capacity_command")
    fc = sub.add_parser("forecast", help="expected demand per pool and tier: the cron schedule and "
                        "the last 7 days' history",
                        description=f"{sys.modules['beat.forecast'].__doc__}\n"
                                    f"{sys.modules['gateway_tasks.capacity.history'].__doc__}",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    fc.add_argument("--horizon-s", type=int, default=DEFAULT_HORIZON_S,
                    help="how far ahead (default %(default)s)")
    fc.add_argument("--bucket-s", type=int, default=DEFAULT_BUCKET_S, help="bin size (default %(default)s)")
    fc.add_argument("--published", action="store_true",
                    help="show the forecast the leader beat last published instead of computing it")
    fc.add_argument("--json", action="store_true", help="print JSON")
    fc.set_defaults(func=cmd_forecast)
