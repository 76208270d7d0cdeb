"""`gateway-dev bench`, part 2: one policy's run on the upstream simulator.

Per policy, on a fresh key prefix (deleted afterwards), with one gateway worker
(threads pool) and the shared simulator reset to full buckets:

1. **Backlog.** ``batch`` long batch tasks are submitted first, then a normal
   backlog, then a VIP backlog -- through the real producer
   (``Gateway.submit``; ``extra_body.sim_completion_tokens`` fixes each reply's
   length).  The normal and VIP backlogs are sized so that neither can run dry
   before the end of phase B even if its tier got the whole TPM.
2. **Phase A, all tiers backlogged.**  After ``warmup_s`` (the buckets start
   full, and the bell holds one wake-up per enqueue), a ``seconds`` window:
   token shares per tier, upstream TPM utilisation, dispatch round trips.
3. **Phase B, VIP latency under a batch flood.**  The rest of the VIP backlog
   is deleted (its queue key); batch and normal stay backlogged; VIP tasks
   now arrive steadily at ``vip_rate``/s for ``seconds``.  Queue waits per tier
   come from the results (``timing.queue_wait_ms`` = dispatched_ms -
   enqueued_ms, both Redis TIME) of the tasks dispatched in that window.

Where each number comes from:

* token shares: deltas of the pool's stats hash over the window --
  ``actual_tokens:<tier>`` (settle.lua: the usage the upstream reported, i.e.
  what each tier really got; the target is judged on these) and
  ``est_tokens:<tier>`` (pick.lua: what the scheduler charged at dispatch; WFQ
  orders by these).  Replies are forced to ~90 % of max_tokens in every tier,
  so the two agree to within a point or so.
* TPM utilisation: the simulator's own ``served_per_s`` tokens over the whole
  seconds of the window / (tpm / 60 * seconds).  Both processes read the same
  CLOCK_MONOTONIC, so the window maps onto the series exactly.
* 429s: the simulator's ``requests_429`` against all its answers over the
  whole run (warm-up included).
* round trips: deltas of ``Keys.dispatch_stats`` (the transport flushes its
  picks / waits / dispatched counters every 50 round trips, so a window's
  figure is exact to +-50 round trips); per dispatched message.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, Settings
from devtools.quotas import for_load
from gateway_tasks.dispatch.broker import purge_tier
from devtools import processes
from devtools.bench.utilisation import UpstreamPoint, window_utilisation
from devtools.bench.results import count_existing, result_metas
from devtools.measure import counter_delta, percentile
from devtools.run_redis import discard_prefix
from gateway_tasks.simulator import SimConfig
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.core.stats import (ACTUAL_TOKENS, COMPLETED, DISPATCH_DISPATCHED, DISPATCH_PICKS,
                                      DISPATCH_WAITS, DISPATCHED, EST_TOKENS, UPSTREAM_429, tier_field)

MODEL = "gpt-4o-mini"
TIERS = ("vip", "normal", "batch")
Progress = Callable[[str], None]
STARTUP_SLACK_S = 4.0  # the worker dispatches from its start, before it answers the ping


@dataclass(frozen=True)
class TierLoad:
    """What one tier's requests look like."""

    prompt: str          # '{i}' is replaced by the request number
    max_tokens: int
    completion_tokens: int  # forced reply length (sim_completion_tokens)


TIER_LOADS = {
    "vip": TierLoad("VIP question {i}: what is the status of order 4411 right now?", 90, 80),
    "normal": TierLoad("Normal request {i}: draft a short reply to this customer email about a "
                       "delayed delivery, keep it polite.", 300, 270),
    "batch": TierLoad("Batch job {i}: summarise document {i} in detail, covering every section, "
                      "the main arguments, the evidence given, open questions and a list of "
                      "action items for the team.", 1000, 900),
}


@dataclass(frozen=True)
class LoadSpec:
    """The scenario: upstream quota and latency, worker, backlog and phases."""

    tpm: int = 600_000            # 10k tokens/s: ~1k tokens/s of batch at a 10 % share
    rpm: int = 60_000             # far above the request rate: TPM is the binding limit
    burst_s: float = 2.0          # bucket = 2 s of quota (gateway and simulator alike)
    base_latency_ms: float = 20.0
    ms_per_output_token: float = 0.02
    concurrency: int = 32
    pool: str = "threads"
    batch: int = 5000
    seconds: float = 20.0         # measurement window of each phase
    warmup_s: float = 4.0         # phase A, before its window
    settle_s: float = 1.0         # between phase A and B (in-flight VIP backlog finishes)
    grace_s: float = 3.0          # after phase B: wait this long at most for VIP results
    vip_rate: float = 20.0        # phase B arrivals per second
    tenants_per_tier: int = 4

    def phase_a_s(self) -> float:
        return self.warmup_s + self.seconds

    def phase_b_s(self) -> float:
        return self.settle_s + self.seconds

    def tokens_per_s(self) -> float:
        return self.tpm / 60.0

    def backlog(self, tier: str) -> int:
        """Tasks enqueued before the worker starts (batch: as asked).

        Sized so the tier cannot run dry even if it got the whole TPM while it
        matters: vip through phase A (plus the worker's start-up, during which it
        already dispatches, and one bucket of burst); normal through phase B and
        the grace period, plus a fifth of phase A (strict and aging hand normal
        ~all of phase B; wfq gives it 20 % of A).
        """
        if tier == "batch":
            return self.batch
        load = TIER_LOADS[tier]
        per_task = load.completion_tokens + 25          # ~ actual tokens of one task
        most_per_s = self.tokens_per_s() / per_task     # if this tier got the whole TPM
        phase_a = STARTUP_SLACK_S + self.phase_a_s()
        if tier == "vip":
            span = phase_a + self.burst_s               # + one full bucket at the start
        else:
            span = self.phase_b_s() + self.grace_s + 0.3 * phase_a
        return int(math.ceil(most_per_s * span * 1.2)) + 50


# -- helpers ---------------------------------------------------------------------
def _ints(raw: dict[bytes, bytes]) -> dict[str, int]:
    out = {}
    for k, v in raw.items():
        try:
            out[k.decode()] = int(float(v))
        except ValueError:
            pass
    return out


@dataclass(frozen=True)
class Snapshot:
    monotonic: float
    redis_ms: int
    stats: dict[str, int]
    dispatch: dict[str, int]


def snapshot(r: redis.Redis, keys: Keys, pool: str) -> Snapshot:
    with r.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.stats(pool))
        pipe.hgetall(keys.dispatch_stats)
        pipe.time()
        mono = time.monotonic()
        stats, dispatch, (sec, usec) = pipe.execute()
    return Snapshot(mono, int(sec) * 1000 + int(usec) // 1000, _ints(stats), _ints(dispatch))


def window_tiers(a: Snapshot, b: Snapshot) -> dict[str, dict[str, Any]]:
    """Per-tier dispatches and tokens between two snapshots, with token shares."""
    rows = {}
    for tier in TIERS:
        rows[tier] = {
            "dispatched": counter_delta(a.stats, b.stats, tier_field(DISPATCHED, tier)),
            "completed": counter_delta(a.stats, b.stats, tier_field(COMPLETED, tier)),
            "est_tokens": counter_delta(a.stats, b.stats, tier_field(EST_TOKENS, tier)),
            "actual_tokens": counter_delta(a.stats, b.stats, tier_field(ACTUAL_TOKENS, tier)),
        }
    for field, share in (("est_tokens", "share_est_pct"), ("actual_tokens", "share_pct")):
        total = sum(row[field] for row in rows.values())
        for row in rows.values():
            row[share] = round(100.0 * row[field] / total, 2) if total else 0.0
    return rows


def window_dispatch(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    picks = counter_delta(a.dispatch, b.dispatch, DISPATCH_PICKS)
    waits = counter_delta(a.dispatch, b.dispatch, DISPATCH_WAITS)
    dispatched = counter_delta(a.dispatch, b.dispatch, DISPATCH_DISPATCHED)
    return {"picks": picks, "waits": waits, "dispatched": dispatched,
            "round_trips_per_msg": round((picks + waits) / dispatched, 3) if dispatched else None}


def served_in_window(sim_stats: dict[str, Any], start_mono: float, end_mono: float,
                     tokens_per_s: float) -> dict[str, Any]:
    """Upstream tokens served in the whole seconds of [start, end), from the simulator."""
    series = sim_stats["served_per_s"]
    first = int(series["first_second"])
    tokens = series["tokens"]
    s0, s1 = int(math.ceil(start_mono)), int(math.floor(end_mono))
    seconds = [s for s in range(s0, s1) if 0 <= s - first < len(tokens)]
    if not seconds:
        return {"seconds": 0, "served_tokens": 0, "served_tokens_per_s": None,
                "tpm_utilisation_pct": None}
    served = sum(tokens[s - first] for s in seconds)
    per_s = served / len(seconds)
    return {"seconds": len(seconds), "served_tokens": served,
            "served_tokens_per_s": round(per_s, 1),
            "tpm_utilisation_pct": round(100.0 * per_s / tokens_per_s, 2)}


def used_in_window(sim_stats: dict[str, Any], a: Snapshot, b: Snapshot, up_a: UpstreamPoint,
                   up_b: UpstreamPoint, tokens_per_s: float) -> dict[str, Any]:
    """The window's TPM use: ``tpm_utilisation_pct`` is the quota really used (the
    simulator's own accounting, ``bench.utilisation``); the tokens-served figure,
    which moves with what the bucket holds at either end, stays as ``served_pct``."""
    out = served_in_window(sim_stats, a.monotonic, b.monotonic, tokens_per_s)
    exact = window_utilisation(up_a, up_b, tokens_per_s)
    out["served_pct"] = out["tpm_utilisation_pct"]
    out["tpm_utilisation_pct"] = exact["utilisation_pct"]
    out["bucket_drawdown_tokens"] = exact["bucket_drawdown_tokens"]
    out["wasted_tokens"] = exact["wasted_tokens"]
    return out


def wait_stats(waits: Sequence[float], missing: int = 0) -> dict[str, Any]:
    """p50/p99/max of queue waits; `missing` tasks never dispatched count as +infinity."""
    values = list(waits) + [math.inf] * missing
    out: dict[str, Any] = {"tasks": len(waits), "undispatched": missing}
    if not values:
        out.update(wait_p50_ms=None, wait_p99_ms=None, wait_max_ms=None)
        return out
    for name, q in (("wait_p50_ms", 50), ("wait_p99_ms", 99)):
        v = percentile(values, q)
        out[name] = None if math.isinf(v) else round(v, 1)
    out["wait_max_ms"] = round(max(waits), 1) if waits else None
    out["censored"] = out["wait_p99_ms"] is None
    return out


def read_results(r: redis.Redis, app: Any, task_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The successful results among these task ids (bulk MGET of the result keys)."""
    metas = result_metas(r, [app.backend.get_key_for_task(t) for t in task_ids])
    return [meta["result"] for meta in metas
            if meta.get("status") == "SUCCESS" and isinstance(meta.get("result"), dict)]


def count_results(r: redis.Redis, app: Any, task_ids: Sequence[str]) -> int:
    return count_existing(r, [app.backend.get_key_for_task(t) for t in task_ids])


# -- the run ---------------------------------------------------------------------
class Submitter:
    """Submits one tier's requests through the real producer, round-robin over its tenants."""

    def __init__(self, gw: Gateway, tenants_per_tier: int):
        self.gw = gw
        self.tenants = {t: [f"bench-{t}-{k}" for k in range(tenants_per_tier)] for t in TIERS}
        self.count = {t: 0 for t in TIERS}
        for tier, names in self.tenants.items():
            for name in names:
                gw.register_tenant(name, tier)

    def submit(self, tier: str) -> str:
        i = self.count[tier]
        self.count[tier] += 1
        load = TIER_LOADS[tier]
        tenant = self.tenants[tier][i % len(self.tenants[tier])]
        handle = self.gw.submit(tenant, load.prompt.format(i=i), max_tokens=load.max_tokens,
                                source="bench",
                                extra_body={"sim_completion_tokens": load.completion_tokens})
        return handle.id


def sim_config(spec: LoadSpec) -> SimConfig:
    return SimConfig(tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s,
                     base_latency_ms=spec.base_latency_ms,
                     ms_per_output_token=spec.ms_per_output_token, models=(MODEL,))


def bench_pool(spec: LoadSpec, base_url: str) -> Pool:
    return Pool("default", base_url=base_url, api_key="sk-bench", models=(MODEL,),
                tpm=spec.tpm, rpm=spec.rpm, burst_s=spec.burst_s)


def run_policy(policy: str, spec: LoadSpec, base: Settings, client: redis.Redis, sim: Any,
               log_dir: str, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Phases A and B for one policy; returns its numbers (see the module docstring)."""
    prefix = f"gt-bench-{policy}-{uuid.uuid4().hex[:8]}:"
    pool = bench_pool(spec, sim.base_url)
    settings = for_load(base.with_(key_prefix=prefix, policy=policy, pools=(pool,)))
    keys = Keys(prefix)
    gw = Gateway(settings, client=client)
    worker = None
    started = time.monotonic()
    try:
        sub = Submitter(gw, spec.tenants_per_tier)
        sim.reset_stats()  # full upstream buckets, zeroed counters (the gateway's start full too)
        ids: dict[str, list[str]] = {t: [] for t in TIERS}
        for tier in ("batch", "normal", "vip"):
            ids[tier] = [sub.submit(tier) for _ in range(spec.backlog(tier))]
        enqueued = {t: len(v) for t, v in ids.items()}
        progress(f"  enqueued {enqueued['batch']} batch, then {enqueued['normal']} normal and "
                 f"{enqueued['vip']} VIP backlog in {time.monotonic() - started:.1f}s")

        worker = processes.worker(settings, concurrency=spec.concurrency, pool=spec.pool,
                                  name=f"bench-{policy}",
                                  log_path=os.path.join(log_dir, f"worker-{policy}.log")).start()
        t_start = time.monotonic()
        processes.wait_for_workers(gw.app, 1, timeout_s=60.0)
        worker_ready_s = time.monotonic() - t_start

        # phase A: all tiers backlogged
        time.sleep(spec.warmup_s)
        a0, up_a0 = snapshot(client, keys, pool.name), UpstreamPoint.from_stats(sim.stats())
        time.sleep(spec.seconds)
        a1, up_a1 = snapshot(client, keys, pool.name), UpstreamPoint.from_stats(sim.stats())

        # phase B: the VIP backlog goes; VIP now arrives steadily
        purge_tier(client, keys, pool.name, "vip")
        time.sleep(spec.settle_s)
        vip_b: list[str] = []
        b0, up_b0 = snapshot(client, keys, pool.name), UpstreamPoint.from_stats(sim.stats())
        interval = 1.0 / spec.vip_rate
        n_vip = max(1, int(round(spec.seconds * spec.vip_rate)))
        t_next = time.monotonic()
        for _ in range(n_vip):
            delay = t_next - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            vip_b.append(sub.submit("vip"))
            t_next += interval
        b1, up_b1 = snapshot(client, keys, pool.name), UpstreamPoint.from_stats(sim.stats())
        deadline = time.monotonic() + spec.grace_s
        while time.monotonic() < deadline and count_results(client, gw.app, vip_b) < len(vip_b):
            time.sleep(0.1)
        time.sleep(1.05)  # let the simulator's current second close
        upstream = sim.stats()
        worker.stop()
        worker = None

        results = {t: read_results(client, gw.app, ids[t]) for t in ("normal", "batch")}
        results["vip"] = read_results(client, gw.app, vip_b)
        stats_end = _ints(client.hgetall(keys.stats(pool.name)))
    finally:
        if worker is not None:
            worker.stop()
        discard_prefix(client, prefix)
        gw.app.close()

    phase_a = {
        "window_s": round(a1.monotonic - a0.monotonic, 3),
        "tiers": window_tiers(a0, a1),
        "dispatch": window_dispatch(a0, a1),
        **used_in_window(upstream, a0, a1, up_a0, up_a1, spec.tokens_per_s()),
    }
    waits: dict[str, dict[str, Any]] = {}
    for tier in TIERS:
        in_window = [res["timing"]["queue_wait_ms"] for res in results[tier]
                     if res["timing"].get("dispatched_ms") is not None
                     and b0.redis_ms <= res["timing"]["dispatched_ms"] <= b1.redis_ms]
        if tier == "vip":
            # every VIP sent in phase B counts: one never dispatched waited past the end
            in_window = [res["timing"]["queue_wait_ms"] for res in results["vip"]]
            waits[tier] = wait_stats(in_window, missing=len(vip_b) - len(in_window))
            waits[tier]["sent"] = len(vip_b)
        else:
            waits[tier] = wait_stats(in_window)
    phase_b = {
        "window_s": round(b1.monotonic - b0.monotonic, 3),
        "vip_rate_per_s": round(len(vip_b) / max(b1.monotonic - b0.monotonic, 1e-9), 2),
        "waits": waits,
        "tiers": window_tiers(b0, b1),
        "dispatch": window_dispatch(b0, b1),
        **used_in_window(upstream, b0, b1, up_b0, up_b1, spec.tokens_per_s()),
    }
    answered = upstream["requests_ok"] + upstream["requests_429"] + upstream["requests_error"]
    return {
        "policy": policy,
        "prefix": prefix,
        "enqueued": enqueued,
        "worker_ready_s": round(worker_ready_s, 2),
        "all_backlogged": phase_a,
        "vip_arrivals": phase_b,
        "upstream": {
            "requests_ok": upstream["requests_ok"],
            "requests_429": upstream["requests_429"],
            "requests_error": upstream["requests_error"],
            "rate_429_pct": round(100.0 * upstream["requests_429"] / answered, 4) if answered else 0.0,
            "gateway_saw_429": stats_end.get(UPSTREAM_429, 0),
        },
        "runtime_s": round(time.monotonic() - started, 1),
    }


def spec_dict(spec: LoadSpec) -> dict[str, Any]:
    out = asdict(spec)
    out["backlog"] = {t: spec.backlog(t) for t in TIERS}
    out["tier_loads"] = {t: asdict(l) for t, l in TIER_LOADS.items()}
    return out


def end_run(client: Any, prefix: str, *, worker: Any = None, gw: Any = None) -> None:
    """A bench run's end, whatever happened: its worker stopped if it still runs, the run's
    keys deleted, its producer app and Redis client closed."""
    if worker is not None:
        worker.stop()
    discard_prefix(client, prefix)
    if gw is not None:
        gw.app.close()
    client.close()
