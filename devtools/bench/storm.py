"""Benchmark: a cron storm end to end (``gateway-dev cron-bench --storm``).

Many tenants x 3 crons at the same minute, jitter off and then on (and, with
``--compare-lanes``, jitter on with the scheduled lane off: every tier's
``scheduled_lag_tokens`` 0), side by side in one run, through the whole system: real beat replicas
(``celery -A beat.app beat`` x 2: one leads, one waits), real workers
(``celery -A workers.app worker`` x 2, threads), the upstream simulator with a
TPM/RPM limit, results read back from the Celery result backend.

Per mode, on a fresh key prefix (deleted afterwards):

1. a minute boundary B at least ``lead_s`` ahead is chosen; tenants are
   registered (vip/normal/batch = 10/30/60 %) with 3 crons each,
   ``"<B's minute> <B's hour> * * *"`` (each fires once, at B plus its jitter);
2. the simulator is reset (full buckets, zeroed counters), workers and beats
   start; a VIP probe tenant submits ``probe_rate`` requests/s from then on,
   so its latency just before B ("quiet") and during the storm can be compared;
3. beat fires every run at its jittered time; the run ends when every cron
   task has a result (or ``timeout_s``).

**Time compression.**  The real jitter windows are 120 s (normal) and 600 s
(batch): two 10-minute storms would not fit "a few minutes".  The windows are
divided by ``compress`` (20: 6 s and 30 s) and the upstream quota is sized so
that the storm's tokens, spread over the compressed batch window, use
``quota_fill`` of it, the VIP probe's requests included (1.0: the quota of a
deployment sized for its jittered load, no more).  Everything else -- the cron maths, beat's 1 s tick, the bucket, the
queues, the upstream latency -- runs in real time.  The same quota serves
both modes, so jitter off sees the same storm all at once.

What is measured, per mode:

* upstream requests/s: the simulator's own per-second count of served
  requests over [B, last cron task completed]: peak, mean and peak/mean in 1 s
  bins (judged) and 5 s bins (shown); its 429s over all its answers;
* per tier, the cron tasks' end-to-end latency (completed - enqueued, both
  Redis TIME: what a tenant waits for its run's result once beat fired it)
  p50/p99, the latency from the run's scheduled (jittered) time -- beat's own
  fire lag included: what the storm does to the tenant --, queue wait p99,
  and deferred tasks (held >= 1 s in the queue by the bucket instead of being
  sent into a 429), plus the gateway's 429 requeues;
* the VIP probe's p99 before B and during the storm, split into queue wait, the
  upstream call (the simulator's own time, from its ``openai-processing-ms``, and
  the rest of the call: connection and worker process) and the rest of the
  worker's time; and beat's fire lag (enqueue time - scheduled jittered time) p99.

Beat submits the cron runs with ``source="cron"``: the scheduled lane
(``gateway_tasks.dispatch.lanes``); the probe's requests are interactive.

Targets (judged on jitter on): peak/mean <= 1.25, 429 <= 0.3 %, VIP p99 during
the storm <= 1.5 x its p99 just before it.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any, Callable

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.state import HISTORY_MAX, read_history, read_state
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.core.stats import CRON_DEFERRED, UPSTREAM_429
from gateway_tasks.core.tokens import count_prompt_tokens
from devtools import processes
from devtools.bench.load import count_results, read_results
from devtools.bench.storm_stats import (deferred, first_reached_s, latency_stats,
                                        level_changes, rate_429_pct, rate_stats, targets,
                                        vip_p99_ratio, window_series)
from devtools.measure import percentile
from devtools.run_redis import discard_prefix
from gateway_tasks.simulator import SimConfig
from gateway_tasks.producer.gateway import IDEMPOTENCY_NAMESPACE, Gateway

from beat.fire import run_key
from beat.jitter import jitter_offset_s
from beat.store import CronSpec, CronStore

MODEL = "gpt-4o-mini"
TIERS = ("vip", "normal", "batch")
TIER_MIX = (("vip", 0.10), ("normal", 0.30), ("batch", 0.60))
CRONS_PER_TENANT = 3
PROBE_TENANT = "storm-probe"
QUIET_WINDOW_S = 10.0            # the probe's "before the storm" window: [B - 10 s, B)
NO_LANES_MODE = "jitter_on_no_lanes"
NO_KEPT_SLOTS_MODE = "jitter_on_no_kept_slots"
TIERED_MODE = "jitter_on_tiered"   # jitter on, one worker per tier (deploy/k8s's layout)
SWITCH_MODE = "jitter_on_switch"   # jitter on, the workers' GIL switch interval changed
PYTHON_SIM_MODE = "jitter_on_python_sim"   # jitter on, the simulator on the pure-Python HTTP stack
NO_GC_FREEZE_MODE = "jitter_on_no_gc_freeze"   # jitter on, the workers' startup objects not frozen
NO_BACKLOG_MODE = "jitter_on_no_backlog"   # jitter on, the load level blind to the queue's backlog
Progress = Callable[[str], None]


@dataclass(frozen=True)
class StormSpec:
    tenants: int = 1000
    compress: int = 20
    quota_fill: float = 1.0
    max_tokens: int = 48
    burst_s: float = 1.0
    base_latency_ms: float = 150.0
    ms_per_output_token: float = 2.0
    workers: int = 2
    concurrency: int = 16
    beats: int = 2
    lead_s: float = 22.0
    probe_rate: float = 2.0
    timeout_s: float = 150.0
    scheduled_lag_tokens: int | None = None   # every tier's lag (None: the settings' own)
    compare_lanes: bool = False               # a third mode: jitter on, lanes off (lag 0)
    compare_slots: bool = False               # another: jitter on, no worker slots kept for vip
    compare_layout: bool = False              # another: jitter on, one worker per tier, same slots
    compare_switch_ms: float | None = None    # another: jitter on, the workers' switch interval this
    sim_stack: str = "native"                 # the simulator's HTTP stack (SimConfig.server_stack)
    compare_sim_stack: bool = False           # another: jitter on, the simulator on the pure-Python one
    compare_gc_freeze: bool = False           # another: jitter on, the workers' gc freeze off
    compare_backlog: bool = False             # another: jitter on, the overload backlog signal off

    def tenants_of(self) -> list[tuple[str, str]]:
        """(tenant id, tier) of every storm tenant."""
        out: list[tuple[str, str]] = []
        for tier, share in TIER_MIX:
            out += [(f"storm-{tier}-{i}", tier) for i in range(max(1, round(self.tenants * share)))]
        return out


def prompt(tenant: str, k: int) -> str:
    return f"Nightly digest {k} for {tenant}: summarise the day."


PROBE_MAX_TOKENS = 16


def probe_prompt(i: int) -> str:
    return f"Probe {i}: are you there?"


def _charged(content: str, max_tokens: int) -> int:
    """What the simulator charges a request: prompt + its reply (~60 % of max_tokens)."""
    return count_prompt_tokens([{"role": "user", "content": content}]) + \
        math.ceil(max_tokens * SimConfig().completion_fraction)


def tokens_per_run(spec: StormSpec) -> int:
    return _charged(prompt("storm-normal-100", 1), spec.max_tokens)


def quota(spec: StormSpec, base: Settings) -> tuple[int, int]:
    """(TPM, RPM) of the upstream: the storm's tokens over the compressed batch window plus
    the VIP probe's, / fill; RPM 1.5 x the matching request rate, so tokens bind first."""
    window_s = max(1, base.tier("batch").jitter_window_s // spec.compress)
    runs = len(spec.tenants_of()) * CRONS_PER_TENANT
    tokens_per_s = runs * tokens_per_run(spec) / window_s + \
        spec.probe_rate * _charged(probe_prompt(100), PROBE_MAX_TOKENS)
    requests_per_s = runs / window_s + spec.probe_rate
    return (math.ceil(tokens_per_s * 60 / spec.quota_fill),
            math.ceil(requests_per_s * 60 / spec.quota_fill * 1.5))


@dataclass(frozen=True)
class StormMode:
    """One run of the storm: its name, jitter on or off, and what it changes in the settings
    (None: the settings' own) or in the workers' layout."""

    name: str
    jitter: bool
    lag: int | None = None                 # every tier's scheduled lag, tokens
    kept_slots: int | None = None          # worker slots kept for vip
    switch_interval_ms: float | None = None  # the workers' GIL switch interval
    tiered: bool = False                   # one worker per tier (deploy/k8s's layout)
    sim_stack: str | None = None           # the simulator's HTTP stack (None: the spec's)
    gc_freeze: bool | None = None          # the workers' startup objects frozen
    backlog_signal: bool | None = None     # the load level's backlog signal (Overload.backlog_signal)


def storm_settings(base: Settings, spec: StormSpec, run: StormMode, prefix: str, pool: Pool) -> Settings:
    """One run's settings: the jitter windows compressed (or 0), the scheduled lag of every
    tier (the run's, else the spec's, else the settings' own), and the run's worker slots
    kept for vip, switch interval, gc freeze and overload backlog signal (None: the settings' own)."""
    lag = spec.scheduled_lag_tokens if run.lag is None else run.lag
    tiers = tuple(replace(t, jitter_window_s=(t.jitter_window_s // spec.compress if run.jitter else 0),
                          scheduled_lag_tokens=t.scheduled_lag_tokens if lag is None else lag)
                  for t in base.tiers)
    changes = {name: value for name, value in (("reserved_worker_slots", run.kept_slots),
                                               ("worker_switch_interval_ms", run.switch_interval_ms),
                                               ("worker_gc_freeze", run.gc_freeze)) if value is not None}
    if run.backlog_signal is not None:
        changes["overload"] = replace(base.overload, backlog_signal=run.backlog_signal)
    return base.with_(key_prefix=prefix, tiers=tiers, pools=(pool,), policy="wfq", **changes)


def storm_modes(spec: StormSpec) -> list[StormMode]:
    """Each run: jitter off, jitter on, then the comparisons asked for -- with
    ``compare_lanes`` jitter on with no scheduled lane, ``compare_slots`` with no worker slot
    kept for vip, ``compare_layout`` with one worker per tier, ``compare_switch_ms`` with the
    workers' switch interval that many ms, ``compare_sim_stack`` with the simulator serving HTTP
    on the pure-Python stack (asyncio + h11), ``compare_gc_freeze`` with the workers' startup
    objects left to full collections, ``compare_backlog`` with the load level blind to the queue's
    backlog (Overload.backlog_signal off)."""
    modes = [StormMode("jitter_off", False), StormMode("jitter_on", True)]
    if spec.compare_lanes:
        modes.append(StormMode(NO_LANES_MODE, True, lag=0))
    if spec.compare_slots:
        modes.append(StormMode(NO_KEPT_SLOTS_MODE, True, kept_slots=0))
    if spec.compare_layout:
        modes.append(StormMode(TIERED_MODE, True, tiered=True))
    if spec.compare_switch_ms is not None:
        modes.append(StormMode(SWITCH_MODE, True, switch_interval_ms=spec.compare_switch_ms))
    if spec.compare_sim_stack:
        modes.append(StormMode(PYTHON_SIM_MODE, True, sim_stack="python"))
    if spec.compare_gc_freeze:
        modes.append(StormMode(NO_GC_FREEZE_MODE, True, gc_freeze=False))
    if spec.compare_backlog:
        modes.append(StormMode(NO_BACKLOG_MODE, True, backlog_signal=False))
    return modes


class BacklogWatch:
    """The load level's backlog signal as the controller last committed it (its state's
    signals), seen every poll of the storm: its peak (seconds of the pool's TPM queued) and
    when, in seconds after the boundary."""

    def __init__(self, boundary_s: float):
        self.boundary_s = boundary_s
        self.peak_s, self.peak_at_s = 0.0, None

    def see(self, signals: dict[str, Any], now_s: float) -> None:
        held = max((float(v) for v in (signals.get("backlog_s") or {}).values()), default=0.0)
        if held > self.peak_s:
            self.peak_s, self.peak_at_s = held, round(now_s - self.boundary_s, 1)

    def to_json(self) -> dict[str, Any]:
        return {"peak_s": round(self.peak_s, 1), "peak_at_s": self.peak_at_s}


def tier_worker_slots(total: int) -> dict[str, int]:
    """The threads of each tier's own worker when ``total`` threads are split as deploy/k8s
    splits replicas (one Deployment per tier, consuming only its tier's queues): a quarter
    for vip, the rest halved between normal and batch; at least one each."""
    vip = max(1, total // 4)
    normal = max(1, (total - vip) // 2)
    return {"vip": vip, "normal": normal, "batch": max(1, total - vip - normal)}


def task_id_of(tenant: str, entry_id: str, nominal_ms: int, run_secret: str) -> str:
    """The task id beat's submit gets for one run (producer idempotency, beat.fire.run_key)."""
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{tenant}:{run_key(entry_id, nominal_ms, run_secret)}"))


class Probe(threading.Thread):
    """Submits one VIP request every 1/rate s through its own producer until stopped."""

    def __init__(self, settings: Settings, rate: float):
        super().__init__(name="storm-probe", daemon=True)
        self.gw = Gateway(settings)
        self.interval_s = 1.0 / rate
        self.sent: list[tuple[str, float]] = []      # (task id, wall time sent)
        self.errors = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        i = 0
        next_t = time.monotonic()
        while not self._stop_event.is_set():
            try:
                h = self.gw.submit(PROBE_TENANT, probe_prompt(i), max_tokens=PROBE_MAX_TOKENS,
                                   model=MODEL, source="bench")
                self.sent.append((h.id, time.time()))
            except Exception:  # noqa: BLE001 -- a failed probe is counted, the bench goes on
                self.errors += 1
            i += 1
            next_t += self.interval_s
            self._stop_event.wait(max(0.0, next_t - time.monotonic()))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10.0)
        self.gw.app.close()
        self.gw.r.close()


def beat_child(settings: Settings, name: str, log_dir: str) -> processes.Child:
    argv = [sys.executable, "-m", "celery", "-A", "beat.app", "beat", "-l", "info",
            "-s", os.path.join(log_dir, f"{name}-schedule")]
    return processes.Child(argv, processes.child_env(settings), os.path.join(log_dir, f"{name}.log"))


def deferred_runs(client: redis.Redis, keys: Keys, specs: Any) -> list[str]:
    """The tenants of the runs beat recorded as deferred at submit (one per run: each entry
    fires once in the storm)."""
    specs = list(specs)
    with client.pipeline(transaction=False) as pipe:
        for spec in specs:
            pipe.hget(keys.cron(f"{spec.tenant_id}:{spec.task_id}"), "last_status")
        statuses = pipe.execute()
    return [spec.tenant_id for spec, status in zip(specs, statuses) if status == CRON_DEFERRED.encode()]


def _load_avg() -> list[float] | None:
    """The machine's 1/5/15-minute load average (None where the OS does not tell)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _wall_to_mono(wall_s: float) -> float:
    return time.monotonic() - time.time() + wall_s


def run_mode(run: StormMode, spec: StormSpec, base: Settings, client: redis.Redis, sim: Any,
             log_dir: str, progress: Progress = lambda _: None) -> dict[str, Any]:
    mode, jitter = run.name, run.jitter
    tpm, rpm = quota(spec, base)
    prefix = f"gt-storm-{mode}-{uuid.uuid4().hex[:8]}:"
    pool = Pool("default", base_url=sim.base_url, api_key="sk-bench", models=(MODEL,), tpm=tpm,
                rpm=rpm, burst_s=spec.burst_s)
    settings = storm_settings(base, spec, run, prefix, pool)
    gw = Gateway(settings, client=client)
    children: list[processes.Child] = []
    probe: Probe | None = None
    started = time.monotonic()
    try:
        boundary_s = math.ceil((time.time() + spec.lead_s) / 60.0) * 60
        boundary_ms = boundary_s * 1000
        at = datetime.fromtimestamp(boundary_s, timezone.utc)
        cron = f"{at.minute} {at.hour} * * *"
        tenants = spec.tenants_of()
        for tenant, tier in tenants:
            gw.register_tenant(tenant, tier)
        gw.register_tenant(PROBE_TENANT, "vip")
        specs = [CronSpec(t, f"digest-{k}", cron,
                          {"messages": [{"role": "user", "content": prompt(t, k)}], "model": MODEL,
                           "max_tokens": spec.max_tokens})
                 for t, _ in tenants for k in range(CRONS_PER_TENANT)]
        store = CronStore(client, settings)
        store.add_many(specs)
        secrets = {e.entry_id: e.run_secret for e in store.list()}
        tier_of = dict(tenants)
        expected = {task_id_of(s.tenant_id, f"{s.tenant_id}:{s.task_id}", boundary_ms,
                               secrets[f"{s.tenant_id}:{s.task_id}"]): s for s in specs}
        sim.reset_stats()
        if run.tiered:
            layout = tier_worker_slots(spec.workers * spec.concurrency)
            for tier, threads in layout.items():
                children.append(processes.worker(settings, queues=[settings.queue_name(tier, pool.name)],
                                                 concurrency=threads, name=f"storm-{mode}-{tier}",
                                                 log_path=os.path.join(log_dir, f"worker-{mode}-{tier}.log")).start())
        else:
            layout = {"every tier": spec.workers * spec.concurrency}
            for i in range(spec.workers):
                children.append(processes.worker(settings, concurrency=spec.concurrency, name=f"storm-{mode}-{i}",
                                                 log_path=os.path.join(log_dir, f"worker-{mode}-{i}.log")).start())
        workers_started = len(children)
        for i in range(spec.beats):
            children.append(beat_child(settings, f"beat-{mode}-{i}", log_dir).start())
        processes.wait_for_workers(gw.app, workers_started, timeout_s=60.0)
        probe = Probe(settings, spec.probe_rate)
        probe.start()
        progress(f"  {mode}: {len(specs)} crons of {len(tenants)} tenants at {at:%H:%M}:00 UTC "
                 f"(in {boundary_s - time.time():.0f} s); upstream {tpm} TPM, {rpm} RPM, "
                 f"burst {spec.burst_s:g} s; vip scheduled lag {settings.tier('vip').scheduled_lag_tokens} tokens")
        ids = list(expected)
        deadline = boundary_s + spec.timeout_s
        window_s = max(t.jitter_window_s for t in settings.tiers)
        stats_key = Keys(prefix).cron_stats
        backlog = BacklogWatch(boundary_s)
        while time.time() < deadline:
            backlog.see(read_state(client, Keys(prefix)).signals, time.time())
            # done when every run has a result or was deferred at submit (overload: its tier's
            # new work is refused at this load level; beat counts it, it never runs)
            if time.time() > boundary_s + window_s and count_results(client, gw.app, ids) + \
                    int(client.hget(stats_key, CRON_DEFERRED) or 0) >= len(ids):
                break
            time.sleep(0.5)
        time.sleep(1.0)
        probe.stop()
        probe_ids = list(probe.sent)
        deadline = time.time() + 20
        while time.time() < deadline and count_results(client, gw.app, [p for p, _ in probe_ids]) < len(probe_ids):
            time.sleep(0.25)
        time.sleep(1.05)                                    # the simulator's last second closes
        upstream = sim.stats()
        requeued_429 = int(client.hget(Keys(prefix).stats(pool.name), UPSTREAM_429) or 0)
        fired = {k.decode(): int(v) for k, v in client.hgetall(stats_key).items()}
        deferred_at_submit = deferred_runs(client, Keys(prefix), expected.values())
        results = read_results(client, gw.app, ids)
        levels = level_changes(read_history(client, Keys(prefix), n=HISTORY_MAX), boundary_ms)
        probe_results = {res["task_id"]: res for res in read_results(client, gw.app, [p for p, _ in probe_ids])}
    finally:
        if probe is not None and probe.is_alive():
            probe.stop()
        for child in children:
            child.stop(timeout_s=15.0)
        discard_prefix(client, prefix)
        gw.app.close()

    # -- numbers -----------------------------------------------------------------------
    done_ms = [res["timing"]["completed_ms"] for res in results]
    end_wall_s = (max(done_ms) / 1000.0) if done_ms else time.time()
    series_all = upstream["served_per_s"]
    series = window_series(series_all["first_second"], series_all["requests"],
                           _wall_to_mono(boundary_s), _wall_to_mono(end_wall_s))
    per_tier: dict[str, Any] = {}
    for tier in TIERS:
        mine = [res for res in results if tier_of.get(res["tenant_id"]) == tier]
        n_expected = sum(1 for s in expected.values() if tier_of[s.tenant_id] == tier)
        n_deferred = sum(1 for t in deferred_at_submit if tier_of.get(t) == tier)
        missing = n_expected - n_deferred - len(mine)    # neither run nor deferred: lost, or too late
        e2e = [res["timing"]["completed_ms"] - res["timing"]["enqueued_ms"] for res in mine]
        waits = [res["timing"]["queue_wait_ms"] for res in mine if res["timing"]["queue_wait_ms"] is not None]
        lag, from_scheduled = [], []
        window = settings.tier(tier).jitter_window_s
        for res in mine:
            run = expected.get(res["task_id"])
            if run is None:
                continue
            scheduled_ms = boundary_ms + jitter_offset_s(res["tenant_id"], run.task_id, window, 86_400) * 1000
            lag.append(res["timing"]["enqueued_ms"] - scheduled_ms)
            from_scheduled.append(res["timing"]["completed_ms"] - scheduled_ms)
        per_tier[tier] = {"runs": n_expected, "completed": len(mine), "deferred_at_submit": n_deferred,
                          "e2e": latency_stats(e2e, missing=missing),
                          "from_scheduled": latency_stats(from_scheduled, missing=missing),
                          "queue_wait_p99_ms": round(percentile(waits, 99, default=0.0), 1) if waits else None,
                          "deferred": deferred(waits),
                          "fire_lag_p99_ms": round(percentile(lag, 99, default=0.0), 1) if lag else None,
                          "jitter_window_s": window}
    # the probe's latency before B ("quiet"), during the storm, and during the VIP runs (B
    # to the last VIP run's result: the part of the storm in its own tier, which the
    # scheduled lane is for), and where it goes: queue wait (enqueued -> dispatched), the
    # upstream call -- the simulator's own time (its openai-processing-ms) and the rest, spent
    # in the connection and the worker's process --, and the rest of the worker's time
    vip_done = [res["timing"]["completed_ms"] for res in results if tier_of.get(res["tenant_id"]) == "vip"]
    vip_end_s = max(vip_done) / 1000.0 if vip_done else boundary_s
    windows: dict[str, dict[str, list[float]]] = {
        w: {"e2e": [], "queue_wait": [], "upstream": [], "upstream_own": [], "upstream_outside": [], "worker": []}
        for w in ("quiet", "storm", "vip_runs")}
    for task_id, sent_s in probe_ids:
        res = probe_results.get(task_id)
        if res is None:
            continue
        if boundary_s - QUIET_WINDOW_S <= sent_s < boundary_s:
            mine = [windows["quiet"]]
        elif boundary_s <= sent_s <= end_wall_s:
            mine = [windows["storm"]] + ([windows["vip_runs"]] if sent_s <= vip_end_s else [])
        else:
            continue
        t = res["timing"]
        upstream_ms = float(t.get("upstream_ms") or 0.0)
        own_ms = t.get("upstream_processing_ms")    # the simulator's own time for the call
        for window in mine:
            window["e2e"].append(t["completed_ms"] - t["enqueued_ms"])
            window["queue_wait"].append(t["queue_wait_ms"] or 0)
            window["upstream"].append(upstream_ms)
            if own_ms is not None:
                window["upstream_own"].append(float(own_ms))
                window["upstream_outside"].append(upstream_ms - float(own_ms))
            window["worker"].append(t["completed_ms"] - t["dispatched_ms"] - upstream_ms)
    probe_stats = {w: latency_stats(parts["e2e"]) for w, parts in windows.items()}
    for w, stats in probe_stats.items():
        for part in ("queue_wait", "upstream", "upstream_own", "upstream_outside", "worker"):
            values = windows[w][part]
            stats[f"{part}_p99_ms"] = round(percentile(values, 99), 1) if values else None
    quiet_stats, storm_stats = probe_stats["quiet"], probe_stats["storm"]
    probe_stats["vip_runs"]["window_s"] = round(vip_end_s - boundary_s, 1)
    return {
        "mode": mode, "jitter": jitter,
        "scheduled_lag_tokens": {t.name: t.scheduled_lag_tokens for t in settings.tiers},
        "reserved_worker_slots": settings.reserved_worker_slots,
        "worker_switch_interval_ms": settings.worker_switch_interval_ms,
        "worker_gc_freeze": settings.worker_gc_freeze,
        "backlog_signal": settings.overload.backlog_signal,
        "sim_stack": sim.config.server_stack,
        "worker_threads": layout,
        "load_avg": _load_avg(),
        "boundary_utc": f"{at:%Y-%m-%dT%H:%M:%SZ}",
        "quota": {"tpm": tpm, "rpm": rpm, "burst_s": spec.burst_s},
        "runs": len(expected), "completed": len(results), "fired": fired,
        "deferred_at_submit": len(deferred_at_submit),
        "storm_s": round(end_wall_s - boundary_s, 1),
        # the load level's changes, s from B (what decides how much batch work is deferred)
        "levels": levels, "l3_at_s": first_reached_s(levels, 3), "backlog": backlog.to_json(),
        "upstream": {
            "rate": rate_stats(series, 1), "rate_5s": rate_stats(series, 5),
            "requests_ok": upstream["requests_ok"], "requests_429": upstream["requests_429"],
            "rate_429_pct": rate_429_pct(upstream["requests_ok"], upstream["requests_429"],
                                         upstream["requests_error"]),
            "series": series,
        },
        "tiers": per_tier,
        "deferred": sum(t["deferred"] for t in per_tier.values()),
        "requeued_after_429": requeued_429,
        "vip_probe": {"quiet": quiet_stats, "storm": storm_stats, "vip_runs": probe_stats["vip_runs"],
                      "errors": probe.errors if probe else 0,
                      "p99_ratio": vip_p99_ratio(quiet_stats["p99_ms"], storm_stats["p99_ms"]),
                      "vip_runs_p99_ratio": vip_p99_ratio(quiet_stats["p99_ms"], probe_stats["vip_runs"]["p99_ms"])},
        "runtime_s": round(time.monotonic() - started, 1),
    }


def run_storm(client: redis.Redis, base: Settings, spec: StormSpec = StormSpec(),
              progress: Progress = lambda _: None) -> dict[str, Any]:
    from gateway_tasks.simulator.runner import SimulatorProcess

    tpm, rpm = quota(spec, base)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gateway-storm-") as log_dir:
        sim_cfg = SimConfig(tpm=tpm, rpm=rpm, burst_s=spec.burst_s, base_latency_ms=spec.base_latency_ms,
                            ms_per_output_token=spec.ms_per_output_token, models=(MODEL,))
        modes = {}
        for run in storm_modes(spec):      # each run on a simulator of its own: fresh, its stack
            with SimulatorProcess(replace(sim_cfg, server_stack=run.sim_stack or spec.sim_stack)) as sim:
                modes[run.name] = run_mode(run, spec, base, client, sim, log_dir, progress)
    return {"spec": asdict(spec), "tokens_per_run": tokens_per_run(spec), "modes": modes,
            "targets": targets(modes["jitter_on"]), "runtime_s": round(time.monotonic() - started, 1)}
