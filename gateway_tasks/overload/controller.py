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
The same thread runs ``gateway_tasks.upstream.rescue.Rescuer`` each tick (queued reserved-tier
tasks off a drained or open pool), with the controller disabled too.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import redis
from celery.signals import worker_ready, worker_shutdown

from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.dispatch.index_entry import IndexEntry, mean_est_tokens, tenant_range
from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.levels import QueuedWork, Signals, baseline, hysteresis, measure, target_level
from gateway_tasks.overload.state import HISTORY_MAX, LoadState, parse_state
from gateway_tasks.core.scripts import Scripts, layout, scripts_for
from gateway_tasks.core.settings import Settings
from gateway_tasks.upstream.rescue import Rescuer
from gateway_tasks.core.stats import (ACTUAL_TOKENS, COMPLETED, DISPATCHED, UPSTREAM_429, UPSTREAM_ERRORS,
                                      UPSTREAM_MS, WAIT_MS, tier_field)
from gateway_tasks.core.packer import connection_kwargs

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

    @property
    def script_keys(self) -> list[str]:
        k = self.keys
        return layout(self.SCRIPT).keys(state=k.overload_state, history=k.overload_history,
                                        samples=k.overload_samples)

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(
            version=self.version, min_spacing_ms=self.min_spacing_ms, now_ms=self.now_ms, level=self.level,
            reason=self.reason, signals=json.dumps(self.signals), sample=json.dumps(self.sample),
            samples_kept=self.samples_kept, history_kept=HISTORY_MAX,
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


def read_counters(client: redis.Redis, keys: Keys, settings: Settings) -> Counters:
    """The counters, queue depths and backlog, the stored state and samples: one round trip."""
    with client.pipeline(transaction=False) as pipe:
        pipe.time()
        for pool in settings.pools:
            pipe.hgetall(keys.stats(pool.name))
            for tier in settings.tiers:
                pipe.zcard(keys.index(pool.name, tier.name))   # a tier's queue length
            for tier in settings.tiers:
                pipe.zrandmember(keys.index(pool.name, tier.name), TOKENS_SAMPLE)
            for tier in settings.tiers:
                pipe.zcard(keys.active(pool.name, tier.name))   # its tenants in line
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
        i += 1 + 3 * n
    state = parse_state(replies[-2])
    samples = []
    for raw in replies[-1]:
        try:
            samples.append(json.loads(raw))
        except ValueError:
            continue
    return Counters({"ts_ms": now_ms, "pools": pools, "tiers": tiers}, depth, queued, state, samples)


def oldest_waits(client: redis.Redis, keys: Keys, settings: Settings, now_ms: int,
                 front: int = FRONT_TENANTS) -> dict[str, float]:
    """Per tier, the age of the oldest queued task among the ``front`` tenants next in line
    in each pool (their heads: each tenant's oldest task), in two round trips.  A bound on
    the tier's oldest wait that costs O(front log n), whatever the number of tenants."""
    pairs = [(p.name, t.name) for p in settings.pools for t in settings.tiers]
    with client.pipeline(transaction=False) as pipe:
        for pool, tier in pairs:
            pipe.zrange(keys.active(pool, tier), 0, front - 1)
        fronts = pipe.execute()
    heads: list[str] = []
    with client.pipeline(transaction=False) as pipe:
        for (pool, tier), tenants in zip(pairs, fronts):
            for tenant in tenants:
                lo, hi = tenant_range(tenant.decode())
                pipe.zrangebylex(keys.index(pool, tier), lo, hi, start=0, num=1)
                heads.append(tier)
        found = pipe.execute() if heads else []
    out: dict[str, float] = {}
    for tier, head in zip(heads, found):
        if head:
            age = max(0.0, float(now_ms - IndexEntry.decode(head[0]).enqueued_ms))
            out[tier] = max(out.get(tier, 0.0), age)
    return out


class OverloadController:
    """One worker's share of the controller (thread-safe ``tick``; ``start`` runs it)."""

    def __init__(self, client: redis.Redis, settings: Settings, scripts: Scripts | None = None):
        self.client = client
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
        oldest = oldest_waits(self.client, self.keys, self.settings, now_ms)
        signals = measure(sample, baseline(read.samples, now_ms, window_ms), tpm, read.depth, o.error_min_calls,
                          oldest, read.queued, o.window_s)
        target, reason = target_level(signals, o, {t.name: t.max_wait_ms for t in self.settings.tiers})
        seen, level = hysteresis(state.seen, target, now_ms, int(o.hold_s * 1000))
        if level > target:
            reason = f"holding L{level} for {o.hold_s:g} s after its last trigger; now: {reason}"
        kept = int(o.window_s / o.tick_s) + EXTRA_SAMPLES
        call = OverloadCommitCall(self.keys, state.version, int(o.tick_s * 800), now_ms, level, reason,
                                  signals.to_json(), sample, kept, seen)
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
                if self.settings.overload.enabled:
                    self.tick()
                rescuer.tick()
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
    controller = OverloadController(redis.Redis.from_url(app.conf.broker_url, **connection_kwargs()), settings).start()
    _running.append(controller)


@worker_shutdown.connect
def _stop_with_the_worker(**_: Any) -> None:
    while _running:
        _running.pop().stop()
