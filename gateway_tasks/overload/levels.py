"""Load levels L0-L4 as pure functions (no I/O, table-tested in tests/test_overload_levels.py).

The controller (gateway_tasks/overload/controller.py) samples the deployment's cumulative
counters every tick; two samples a window apart give the measured signals
(``measure``), the signals give the level they ask for (``target_level``), and
``hysteresis`` turns that into the level in force:

* it rises at once: a signal asking for level k puts the level at k or above now;
* it falls only after the signal stayed below a level for the hold time: each
  level k remembers when a signal last asked for k (``seen``), and the level is
  the highest k asked for within the last ``hold_ms``.  So L3 -> L0 takes one hold
  after the last tick that asked for L1 or more, and a signal hovering around a
  threshold holds the level instead of flapping.

A sample is JSON (it is stored in Redis by lua/overload/commit.lua):
``{"ts_ms": int, "pools": {pool: {"tokens", "ok", "errors", "r429"}},
"tiers": {tier: {"dispatched", "wait_ms", "completed", "upstream_ms"}}}`` -- cumulative
counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gateway_tasks.core.settings import MAX_LEVEL, Overload

Sample = Mapping[str, Any]


@dataclass(frozen=True)
class Signals:
    """What the controller measured over one window."""

    window_ms: int = 0
    utilisation: dict[str, float] = field(default_factory=dict)          # pool -> used / TPM
    error_rate: dict[str, float | None] = field(default_factory=dict)    # pool -> rate (None: too few calls)
    calls: dict[str, int] = field(default_factory=dict)                  # pool -> upstream calls in the window
    queue_depth: int = 0                                                  # tasks queued now, every tier/pool
    wait_ms: dict[str, float | None] = field(default_factory=dict)       # tier -> mean wait of its dispatches
    # tier -> age of the oldest queued task among the tenants next in line (every pool)
    oldest_wait_ms: dict[str, float] = field(default_factory=dict)
    # pool -> seconds of its TPM the queued tasks that can start within the window hold
    # (their estimated tokens / TPM * 60; pool_backlog_tokens)
    backlog_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"window_ms": self.window_ms, "utilisation": self.utilisation,
                "error_rate": self.error_rate, "calls": self.calls,
                "queue_depth": self.queue_depth, "wait_ms": self.wait_ms,
                "oldest_wait_ms": self.oldest_wait_ms, "backlog_s": self.backlog_s}


def baseline(samples: Sequence[Sample], now_ms: int, window_ms: int) -> Sample | None:
    """The sample to measure against: the newest one at least a window old, else the
    oldest one there is (a young deployment measures over what it has); None if there
    is none older than now."""
    older = [s for s in samples if int(s["ts_ms"]) < now_ms]
    if not older:
        return None
    full = [s for s in older if int(s["ts_ms"]) <= now_ms - window_ms]
    if full:
        return max(full, key=lambda s: int(s["ts_ms"]))
    return min(older, key=lambda s: int(s["ts_ms"]))


def _delta(now: Mapping[str, Any], old: Mapping[str, Any], name: str) -> float:
    return max(0.0, float(now.get(name, 0)) - float(old.get(name, 0)))


@dataclass(frozen=True)
class QueuedWork:
    """One tier's queue in one pool, as a tick reads it (gateway_tasks.overload.controller.read_counters)."""

    tier: str
    depth: int                  # tasks queued
    mean_est_tokens: float      # the mean estimated tokens of (a sample of) them
    tenants_in_line: int        # tenants in the tier's active set: with queued work, under their cap
    cap: int                    # the tier's most tasks in flight per tenant (0 = no cap)


def startable_tasks(queue: QueuedWork, window_s: float, latency_s: float | None) -> float:
    """How many of a queue's tasks can start within one window: each tenant in line runs at
    most ``cap`` at once, each of those slots about window / latency tasks one after another
    (at least one; latency unknown: one).  So one tenant's bulk queue behind its own cap
    counts for what that tenant can run, not for all of it; tenants at their cap (parked)
    count for nothing more -- what they run is in the utilisation already."""
    if queue.cap <= 0:
        return float(queue.depth)
    per_slot = max(1.0, window_s / latency_s) if latency_s and latency_s > 0 else 1.0
    return min(float(queue.depth), queue.tenants_in_line * queue.cap * per_slot)


def pool_backlog_tokens(queues: Sequence[QueuedWork], window_s: float,
                        latency_s: Mapping[str, float | None]) -> float:
    """A pool's backlog: the estimated tokens of the tasks its tiers' queues can start
    within one window (``startable_tasks``; ``latency_s``: tier -> mean upstream call time)."""
    return sum(startable_tasks(q, window_s, latency_s.get(q.tier)) * q.mean_est_tokens for q in queues)


def backlog_seconds(backlog_tokens: Mapping[str, float], tpm: Mapping[str, float]) -> dict[str, float]:
    """Per pool, how many seconds of its TPM its queued tasks' estimated tokens hold (pools
    with no TPM left out)."""
    return {pool: round(tokens / tpm[pool] * 60.0, 2)
            for pool, tokens in backlog_tokens.items() if tpm.get(pool, 0) > 0}


def tier_latency_s(now: Sample, old: Sample | None) -> dict[str, float | None]:
    """Per tier, the mean upstream call time of the calls completed between the samples (all
    of them so far when none completed in between or ``old`` is None; None when none ever)."""
    out: dict[str, float | None] = {}
    for tier, counters in now.get("tiers", {}).items():
        before = (old or {}).get("tiers", {}).get(tier, {})
        n, ms = _delta(counters, before, "completed"), _delta(counters, before, "upstream_ms")
        if not n:
            n, ms = float(counters.get("completed", 0)), float(counters.get("upstream_ms", 0))
        out[tier] = round(ms / n / 1000.0, 3) if n else None
    return out


def measure(now: Sample, old: Sample | None, tpm: Mapping[str, float], queue_depth: int,
            min_calls: int, oldest_wait_ms: Mapping[str, float] | None = None,
            queued: Mapping[str, Sequence[QueuedWork]] | None = None, window_s: float = 10.0) -> Signals:
    """The signals between two samples (``old`` None: only the queue's depth, ages and backlog
    are known).  ``queued``: pool -> its tiers' queues; their backlog is what they can start
    within ``window_s`` (``pool_backlog_tokens``)."""
    oldest = dict(oldest_wait_ms or {})
    latency = tier_latency_s(now, old)
    backlog = backlog_seconds({pool: pool_backlog_tokens(qs, window_s, latency)
                               for pool, qs in (queued or {}).items()}, tpm)
    if old is None:
        return Signals(queue_depth=queue_depth, oldest_wait_ms=oldest, backlog_s=backlog)
    window_ms = int(now["ts_ms"]) - int(old["ts_ms"])
    if window_ms <= 0:
        return Signals(queue_depth=queue_depth, oldest_wait_ms=oldest, backlog_s=backlog)
    util: dict[str, float] = {}
    errors: dict[str, float | None] = {}
    calls: dict[str, int] = {}
    for pool, counters in now.get("pools", {}).items():
        before = old.get("pools", {}).get(pool, {})
        capacity = tpm.get(pool, 0) * window_ms / 60_000.0
        if capacity > 0:
            util[pool] = round(_delta(counters, before, "tokens") / capacity, 4)
        failed = _delta(counters, before, "errors") + _delta(counters, before, "r429")
        n = int(failed + _delta(counters, before, "ok"))
        calls[pool] = n
        errors[pool] = round(failed / n, 4) if n >= min_calls else None
    waits: dict[str, float | None] = {}
    for tier, counters in now.get("tiers", {}).items():
        before = old.get("tiers", {}).get(tier, {})
        n = _delta(counters, before, "dispatched")
        waits[tier] = round(_delta(counters, before, "wait_ms") / n, 1) if n else None
    return Signals(window_ms, util, errors, calls, queue_depth, waits, oldest, backlog)


def target_level(signals: Signals, overload: Overload,
                 max_wait_ms: Mapping[str, float]) -> tuple[int, str]:
    """The level the signals ask for, and why (the strongest trigger, in words)."""
    level, reason = 0, "all signals below their thresholds"

    def ask(k: int, why: str) -> None:
        nonlocal level, reason
        if k > level:
            level, reason = k, why

    for pool, u in sorted(signals.utilisation.items()):
        for k, threshold in enumerate(overload.utilisation_thresholds, start=1):
            if u > threshold:
                ask(k, f"pool {pool} utilisation {u:.2f} > {threshold:g}")
    if overload.backlog_signal:
        # the queue already holds this much of the pool's next window: it will be used at
        # least this fully (the utilisation window only sees it once it has been served)
        for pool, backlog_s in sorted(signals.backlog_s.items()):
            committed = backlog_s / overload.window_s
            for k, threshold in enumerate(overload.utilisation_thresholds, start=1):
                if committed > threshold:
                    ask(k, f"pool {pool}'s queue holds {backlog_s:.1f} s of its TPM: utilisation "
                           f"{committed:.2f} of the next {overload.window_s:g} s > {threshold:g}")
    for pool, rate in sorted(signals.error_rate.items()):
        if rate is not None and rate > overload.error_rate_threshold and overload.error_rate_level:
            ask(overload.error_rate_level,
                f"pool {pool} upstream error rate {rate:.2f} > {overload.error_rate_threshold:g}")
    if signals.queue_depth > overload.queue_depth_threshold and overload.queue_depth_level:
        ask(overload.queue_depth_level,
            f"{signals.queue_depth} tasks queued > {overload.queue_depth_threshold}")
    for tier, wait in sorted(signals.wait_ms.items()):
        limit = max_wait_ms.get(tier)
        if wait is not None and limit and wait > limit and overload.wait_level:
            ask(overload.wait_level, f"tier {tier} waited {wait / 1000:.1f} s > its max wait "
                                     f"{limit / 1000:g} s")
    for tier, age in sorted(signals.oldest_wait_ms.items()):
        limit = max_wait_ms.get(tier)
        if limit and age > limit and overload.wait_level:
            ask(overload.wait_level, f"tier {tier}'s oldest queued task has waited {age / 1000:.1f} s "
                                     f"> its max wait {limit / 1000:g} s")
    return level, reason


Seen = tuple[int | None, ...]   # per level 1..MAX_LEVEL: last time (ms) a signal asked for it
NEVER: Seen = (None,) * MAX_LEVEL


def hysteresis(seen: Seen, target: int, now_ms: int, hold_ms: int) -> tuple[Seen, int]:
    """The new ``seen`` and the level in force: the highest level asked for within hold_ms."""
    updated = tuple(now_ms if target >= k else (seen[k - 1] if k - 1 < len(seen) else None)
                    for k in range(1, MAX_LEVEL + 1))
    level = 0
    for k in range(MAX_LEVEL, 0, -1):
        t = updated[k - 1]
        if t is not None and now_ms - t < hold_ms:
            level = k
            break
    return updated, level
