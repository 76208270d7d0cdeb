"""The load-level controller: one decision for the whole deployment, made inside
the workers and coordinated through Redis.

Every worker process runs a ``OverloadController`` thread (started when the
worker is ready).  Each tick (``Overload.tick_s``) it reads the deployment's
cumulative counters (tokens the upstreams reported, completed calls, upstream
errors and 429s per pool; dispatches and queue wait per tier) and the queue
depths in one pipeline, measures them against the sample a window ago, asks the
pure functions of ``gateway_tasks.overload.levels`` for the level, and
commits it with lua/overload/commit.lua.  The commit is a compare-and-set on the
state's version with a least spacing of ``0.8 * tick_s``: however many workers
run, one decision per tick wins and the others only read it.  Every change is
logged, kept in the history list and counted (``gateway_overload_level_changes``).
Each tick also attributes the pressure per tenant (``gateway_tasks.overload.attribution``):
a few tenants over their fair share that alone raise the level are held at that level
(``Keys.overload_held``) and the deployment's level is the one the others cause.
The same thread runs ``gateway_tasks.upstream.rescue.Rescuer`` each tick (queued reserved-tier
tasks off a drained or open pool) and releases held deferred work
(``gateway_tasks.overload.deferral.release_deferred``), with the controller disabled too.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import redis
from celery.signals import worker_ready, worker_shutdown

from gateway_tasks.core.redis_client import data_client, queue_time
from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.dispatch.index_entry import IndexEntry, mean_est_tokens, tenant_range
from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.attribution import Held, TenantDemand, attribute, hold_tenants
from gateway_tasks.overload.deferral import release_deferred, release_room
from gateway_tasks.overload.levels import QueuedWork, Signals, baseline, hysteresis, measure, tier_latency_s
from gateway_tasks.overload.state import HISTORY_MAX, LoadState, parse_state, read_level
from gateway_tasks.core.scripts import Scripts, layout, scripts_for
from gateway_tasks.core.settings import Settings
from gateway_tasks.upstream.rescue import Rescuer
from gateway_tasks.core.stats import (ACTUAL_TOKENS, COMPLETED, DISPATCHED, UPSTREAM_429, UPSTREAM_ERRORS,
                                      UPSTREAM_MS, WAIT_MS, tier_field)

logger = logging.getLogger(__name__)
EXTRA_SAMPLES = 5
FRONT_TENANTS = 16   # tenants next in line whose oldest task the wait signal looks at
TOKENS_SAMPLE = 64  # index entries a tick reads per queue: their mean estimated tokens


@dataclass(frozen=True)
class Decision:
    committed: bool
    level: int
    old_level: int
    reason: str
    signals: Signals

    @property
    def changed(self) -> bool:
        return self.committed and self.level != self.old_level


@dataclass(frozen=True)
class OverloadCommitCall:
    SCRIPT: ClassVar[str] = "overload/commit"

    keys: Keys
    version: int
    min_spacing_ms: int
    now_ms: int
    level: int
    reason: str
    signals: dict[str, Any]
    sample: dict[str, Any]
    samples_kept: int
    seen: tuple[int | None, ...]
    held: dict[str, Held] = field(default_factory=dict)   # tenants held at the level they cause

    @property
    def script_keys(self) -> list[str]:
        k = self.keys
        return layout(self.SCRIPT).keys(state=k.overload_state, history=k.overload_history,
                                        samples=k.overload_samples, held=k.overload_held)

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(
            version=self.version, min_spacing_ms=self.min_spacing_ms, now_ms=self.now_ms, level=self.level,
            reason=self.reason, signals=json.dumps(self.signals), sample=json.dumps(self.sample),
            samples_kept=self.samples_kept, history_kept=HISTORY_MAX,
            held_entries=json.dumps({t: json.dumps(h.to_json()) for t, h in self.held.items()}),
            level_k=[dict(seen="" if t is None else t) for t in self.seen])

    def parse(self, reply: Any) -> tuple[bool, int]:
        """(committed, the level before this decision)"""
        if int(reply[0]) == 0:
            return False, -1
        return True, int(reply[3])


@dataclass(frozen=True)
class Counters:
    """What one tick reads (``read_counters``)."""

    sample: dict[str, Any]              # cumulative counters now (overload_levels.Sample)
    depth: int                          # tasks queued, every tier and pool
    queued: dict[str, list[QueuedWork]]  # pool -> its tiers' queues (depth, tokens, tenants in line)
    state: LoadState
    samples: list[Any]                  # the stored samples
    tenants: dict[str, "PoolTenants"] = field(default_factory=dict)   # pool -> what its tenants ask
    held: dict[str, Held] = field(default_factory=dict)               # the tenants held now


@dataclass(frozen=True)
class PoolTenants:
    """What one pool's tenants ask of it, as a tick reads it: each tier's queue (its depth,
    a sample of its index entries, its tenants in line), the tasks in flight per tenant and
    the tenants parked at their cap (tenant -> tier)."""

    queues: list[tuple[str, int, list[bytes], int]]   # (tier, depth, sampled entries, tenants in line)
    in_flight: dict[str, tuple[str, int, float]]       # tenant -> (tier, tasks, estimated tokens)
    parked: dict[str, str]


def in_flight_of(values: Any) -> dict[str, tuple[str, int, float]]:
    """Per tenant, its tasks in flight on a pool from the pool's dispatched hash
    ('<tier>|<s>|<index entry>' per task): (tier, tasks, their estimated tokens)."""
    out: dict[str, tuple[str, int, float]] = {}
    for raw in values:
        try:
            tier, _, entry = raw.decode().split("|", 2)
            e = IndexEntry.decode(entry)
        except (ValueError, UnicodeDecodeError):
            continue
        _, n, tokens = out.get(e.tenant, (tier, 0, 0.0))
        out[e.tenant] = (tier, n + 1, tokens + e.est_tokens)
    return out


def read_counters(client: redis.Redis, keys: Keys, settings: Settings) -> Counters:
    """The counters, queue depths and backlog, the stored state and samples: one round trip."""
    with client.pipeline(transaction=False) as pipe:
        queue_time(pipe)
        for pool in settings.pools:
            pipe.hgetall(keys.stats(pool.name))
            for tier in settings.tiers:
                pipe.zcard(keys.index(pool.name, tier.name))   # a tier's queue length
            for tier in settings.tiers:
                pipe.zrandmember(keys.index(pool.name, tier.name), TOKENS_SAMPLE)
            for tier in settings.tiers:
                pipe.zcard(keys.active(pool.name, tier.name))   # its tenants in line
            pipe.hgetall(keys.dispatched(pool.name))            # tasks in flight: tier, entry
            pipe.hgetall(keys.parked(pool.name))                # tenants at their cap -> tier
        pipe.hgetall(keys.overload_held)
        pipe.hgetall(keys.overload_state)
        pipe.lrange(keys.overload_samples, 0, -1)
        replies = pipe.execute()
    sec, usec = replies[0]
    now_ms = int(sec) * 1000 + int(usec) // 1000
    pools: dict[str, dict[str, float]] = {}
    tiers = {t.name: {"dispatched": 0.0, "wait_ms": 0.0, "completed": 0.0, "upstream_ms": 0.0}
             for t in settings.tiers}
    depth = 0
    queued: dict[str, list[QueuedWork]] = {}
    tenants: dict[str, PoolTenants] = {}
    i = 1
    for pool in settings.pools:
        stats = {k.decode(): v for k, v in replies[i].items()}
        num = lambda name: float(stats.get(name, 0) or 0)  # noqa: E731
        pools[pool.name] = {
            "tokens": sum(num(tier_field(ACTUAL_TOKENS, t.name)) for t in settings.tiers),
            "ok": sum(num(tier_field(COMPLETED, t.name)) for t in settings.tiers),
            "errors": num(UPSTREAM_ERRORS), "r429": num(UPSTREAM_429)}
        for t in settings.tiers:
            tiers[t.name]["dispatched"] += num(tier_field(DISPATCHED, t.name))
            tiers[t.name]["wait_ms"] += num(tier_field(WAIT_MS, t.name))
            tiers[t.name]["completed"] += num(tier_field(COMPLETED, t.name))
            tiers[t.name]["upstream_ms"] += num(tier_field(UPSTREAM_MS, t.name))
        n = len(settings.tiers)
        depths = [int(d) for d in replies[i + 1:i + 1 + n]]
        depth += sum(depths)
        queued[pool.name] = [
            QueuedWork(t.name, d, mean_est_tokens(entries or []) or 0.0, int(in_line), t.max_concurrency_per_tenant)
            for t, d, entries, in_line in zip(settings.tiers, depths, replies[i + 1 + n:i + 1 + 2 * n],
                                              replies[i + 1 + 2 * n:i + 1 + 3 * n])]
        in_flight, parked = replies[i + 1 + 3 * n], replies[i + 2 + 3 * n]
        tenants[pool.name] = PoolTenants(
            [(t.name, d, list(entries or []), int(in_line))
             for t, d, entries, in_line in zip(settings.tiers, depths, replies[i + 1 + n:i + 1 + 2 * n],
                                               replies[i + 1 + 2 * n:i + 1 + 3 * n])],
            in_flight_of(in_flight.values()),
            {k.decode(): v.decode() for k, v in parked.items()})
        i += 3 + 3 * n
    held = parse_held(replies[-3])
    state = parse_state(replies[-2])
    samples = []
    for raw in replies[-1]:
        try:
            samples.append(json.loads(raw))
        except ValueError:
            continue
    return Counters({"ts_ms": now_ms, "pools": pools, "tiers": tiers}, depth, queued, state, samples,
                    tenants, held)


def parse_held(raw: dict[bytes, bytes]) -> dict[str, Held]:
    """The held tenants as stored (``Keys.overload_held``); unreadable entries left out."""
    out = {}
    for tenant, value in raw.items():
        try:
            h = json.loads(value)
            out[tenant.decode()] = Held(int(h["level"]), int(h["until_ms"]), str(h.get("reason", "")))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def tenant_demand(settings: Settings, tenants: dict[str, PoolTenants], window_s: float,
                  latency_s: dict[str, float | None], ages: dict[tuple[str, str], float]) -> list[TenantDemand]:
    """Each tenant's demand on each pool over the next window, in estimated tokens: its
    tasks in flight (from the pool's dispatched hash) and those of its queue it can start
    within the window (as ``levels.startable_tasks`` counts a queue: at most its cap's
    slots, each window / latency tasks; nothing more while it is parked at its cap).  A
    queue's tenants are read from its sample of index entries, scaled to its depth;
    ``ages``: (pool, tenant) -> its oldest queued task's age."""
    caps = {t.name: t.max_concurrency_per_tenant for t in settings.tiers}
    out = []
    for pool, pt in tenants.items():
        count: dict[str, float] = {}
        tokens: dict[str, float] = {}
        tier_of: dict[str, str] = dict(pt.parked)
        for tier, depth, entries, _ in pt.queues:
            decoded = []
            for raw in entries:
                try:
                    decoded.append(IndexEntry.decode(raw))
                except (ValueError, UnicodeDecodeError):
                    continue
            if not decoded:
                continue
            scale = max(1.0, depth / len(decoded))
            for e in decoded:
                count[e.tenant] = count.get(e.tenant, 0.0) + scale
                tokens[e.tenant] = tokens.get(e.tenant, 0.0) + e.est_tokens * scale
                tier_of[e.tenant] = tier
        for tenant in set(count) | set(pt.in_flight):
            flight_tier, flying, flying_tokens = pt.in_flight.get(tenant, ("", 0, 0.0))
            tier = tier_of.get(tenant) or flight_tier
            queued = count.get(tenant, 0.0)
            mean = tokens[tenant] / queued if queued else 0.0
            latency = latency_s.get(tier)
            per_slot = max(1.0, window_s / latency) if latency else 1.0
            cap = caps.get(tier, 0)
            startable = 0.0 if tenant in pt.parked else (min(queued, cap * per_slot) if cap else queued)
            out.append(TenantDemand(tenant, pool, tier, startable * mean + flying_tokens, queued, flying,
                                    ages.get((pool, tenant), 0.0)))
    return out


def oldest_waits(client: redis.Redis, keys: Keys, settings: Settings, now_ms: int,
                 front: int = FRONT_TENANTS) -> dict[str, float]:
    """Per tier, the age of the oldest queued task among the ``front`` tenants next in line
    in each pool (their heads: each tenant's oldest task), in two round trips.  A bound on
    the tier's oldest wait that costs O(front log n), whatever the number of tenants."""
    return head_ages(client, keys, settings, now_ms, front)[0]


def head_ages(client: redis.Redis, keys: Keys, settings: Settings, now_ms: int,
              front: int = FRONT_TENANTS) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """``oldest_waits``, and the age of each of those tenants' oldest task: (pool, tenant) -> ms."""
    pairs = [(p.name, t.name) for p in settings.pools for t in settings.tiers]
    with client.pipeline(transaction=False) as pipe:
        for pool, tier in pairs:
            pipe.zrange(keys.active(pool, tier), 0, front - 1)
        fronts = pipe.execute()
    heads: list[tuple[str, str, str]] = []     # (pool, tier, tenant)
    with client.pipeline(transaction=False) as pipe:
        for (pool, tier), tenants in zip(pairs, fronts):
            for tenant in tenants:
                heads.append((pool, tier, tenant.decode()))
        for pool, tier, tenant in heads:
            lo, hi = tenant_range(tenant)
            pipe.zrangebylex(keys.index(pool, tier), lo, hi, start=0, num=1)
        found = pipe.execute() if heads else []
    out: dict[str, float] = {}
    ages: dict[tuple[str, str], float] = {}
    for (pool, tier, tenant), head in zip(heads, found):
        if head:
            age = max(0.0, float(now_ms - IndexEntry.decode(head[0]).enqueued_ms))
            ages[(pool, tenant)] = age
            out[tier] = max(out.get(tier, 0.0), age)
    return out, ages


class OverloadController:
    """One worker's share of the controller (thread-safe ``tick``; ``start`` runs it)."""

    def __init__(self, client: redis.Redis, settings: Settings, scripts: Scripts | None = None,
                 app: Any = None):
        self.client = client
        self.app = app     # the worker's Celery app: releases held deferred work (None: not)
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.scripts = scripts or scripts_for(client)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def decide(self) -> tuple[OverloadCommitCall, Signals, LoadState]:
        """Read and compute one decision (no write)."""
        o = self.settings.overload
        read = read_counters(self.client, self.keys, self.settings)
        sample, state = read.sample, read.state
        now_ms = int(sample["ts_ms"])
        window_ms = int(o.window_s * 1000)
        tpm = {p.name: float(p.tpm) for p in self.settings.pools}
        oldest, ages = head_ages(self.client, self.keys, self.settings, now_ms)
        old = baseline(read.samples, now_ms, window_ms)
        signals = measure(sample, old, tpm, read.depth, o.error_min_calls, oldest, read.queued, o.window_s)
        demand = tenant_demand(self.settings, read.tenants, o.window_s, tier_latency_s(sample, old), ages)
        present = {pool: {tier: in_line + sum(1 for t in pt.parked.values() if t == tier)
                          for tier, _, _, in_line in pt.queues} for pool, pt in read.tenants.items()}
        found = attribute(signals, demand, o, {t.name: t.max_wait_ms for t in self.settings.tiers},
                          {t.name: t.share for t in self.settings.tiers}, present,
                          {p.name: p.tpm * o.window_s / 60.0 for p in self.settings.pools})
        target, reason = found.level, found.reason
        hold_ms = int(o.hold_s * 1000)
        seen, level = hysteresis(state.seen, target, now_ms, hold_ms)
        if level > target:
            reason = f"holding L{level} for {o.hold_s:g} s after its last trigger; now: {reason}"
        held = {t: h for t, h in hold_tenants(read.held, found.held, now_ms, hold_ms).items() if h.level > level}
        kept = int(o.window_s / o.tick_s) + EXTRA_SAMPLES
        call = OverloadCommitCall(self.keys, state.version, int(o.tick_s * 800), now_ms, level, reason,
                                  signals.to_json(), sample, kept, seen, held)
        return call, signals, state

    def tick(self) -> Decision:
        call, signals, state = self.decide()
        committed, old = self.scripts.run(call)
        decision = Decision(committed, call.level if committed else state.level,
                            old if committed else state.level, call.reason, signals)
        if decision.changed:
            log = logger.warning if decision.level > decision.old_level else logger.info
            log("load level L%d -> L%d: %s", decision.old_level, decision.level, decision.reason)
        return decision

    def release(self, level: int | None = None, room: dict[str, float] | None = None, early: bool = True) -> None:
        """Release the held deferred work that is due, and (``early``) the work of tiers the
        level no longer defers, within ``room`` (``deferral.release_room``; None = unpaced)."""
        if self.app is None:
            return
        if level is None:
            level = read_level(self.client, self.keys) if self.settings.overload.enabled else 0
        report = release_deferred(self.client, self.app, self.settings, level, redis_now_ms(self.client),
                                  room, early)
        if report.released:
            logger.info("released held deferred tasks at L%d: %s", level, report.released)

    def start(self) -> "OverloadController":
        """The controller's thread; it also moves reserved-tier tasks off blocked pools
        (gateway_tasks/upstream/rescue.py), so it runs even with the controller disabled."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gateway-overload", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = self.settings.overload.tick_s
        rescuer = Rescuer(self.client, self.settings, self.scripts)
        while not self._stop.wait(interval):
            try:
                decision = self.tick() if self.settings.overload.enabled else None
                rescuer.tick()
                if decision is None:
                    self.release(0)
                else:       # early releases paced by the signals, by the tick's one winner
                    self.release(decision.level, release_room(decision.signals, self.settings)
                                 if decision.committed else None, early=decision.committed)
            except redis.RedisError:
                logger.warning("load-level tick failed; retrying in %.1f s", interval, exc_info=True)
            except Exception:  # a controller bug must never take the worker down
                logger.exception("load-level tick failed")


_running: list[OverloadController] = []


@worker_ready.connect
def _start_with_the_worker(sender: Any = None, **_: Any) -> None:
    """Every ready worker process takes part in the decisions (one wins each tick)."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    settings = settings_of(app)
    controller = OverloadController(data_client(settings, "the load-level controller"), settings, app=app).start()
    _running.append(controller)


@worker_shutdown.connect
def _stop_with_the_worker(**_: Any) -> None:
    while _running:
        _running.pop().stop()
