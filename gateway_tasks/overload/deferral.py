"""Deferral that keeps the work: a deferred task is accepted and held, then released.

At submit, a request whose action is ``defer`` (gateway_tasks/overload/actions.py) is held
unless its caller asked for a refusal: its held record (``Keys.held``, the record a task
waiting on its depends_on has: how to send it) gets when and why (lua/overload/defer_hold.lua,
in the task's slot), then its id joins its pool's deferred set of its tier (``Keys.deferred``,
in the pool's slot) scored by ``deferred_until_ms``.  Nothing is queued, so it takes no queue
space; the deferral takes the place of the enqueue on the pool's shard.  The record is
written first and is what a release claims: an id in the set whose record is gone
(cancelled, expired) is only taken out of the set.

Every worker's controller thread releases held work each tick (``release_deferred``):

* what is due (``deferred_until_ms`` has come) is released, whatever the level;
* a tier whose action at the level in force is no longer ``defer`` (the level fell) has its
  held work released before its time, oldest deferral first, paced: each tick only as many
  estimated tokens as one tick of the room its pool has below the L1 utilisation threshold
  (``release_room``, from the tick's signals; at least one task a tick while there is
  room) -- released all at once, a storm's held work raised the level back to L3 at the next
  tick (and released a window's room every tick, before any of it was served, too).  Only
  the worker whose decision won the tick releases early, so the room is given out once;

at most ``Overload.deferred_release_per_tick`` tasks a tick, tiers inside their off-peak
window first, oldest deferral first over the tier's pools.  lua/overload/defer_release.lua
claims each exactly once in its own slot (however many workers tick); the task is then sent
on its tier's queue as the submit would have sent it, and its id taken out of the set.  It joins
its tier as a new arrival: its index entry is stamped at release, so its tenant's start tag
is the tier's virtual time then -- the time spent held earns it no credit over work that
was queued meanwhile and costs it none, and the queue-wait signals do not count the
deferral as queue wait.

A tier's ``off_peak`` window ("00:00-06:00" in ``Overload.off_peak_timezone``) bounds the
hold: ``deferred_until`` is the earlier of the retry time and the window's next opening,
and work deferred inside the window is released at once (``deferred_until_ms``, pure).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar, Sequence
from zoneinfo import ZoneInfo

import redis
from celery import Celery

from gateway_tasks.core.errors import GatewayError
from gateway_tasks.dispatch.message import send_infer
from gateway_tasks.core.keys import Keys, split_queue_name
from gateway_tasks.core.scripts import layout, scripts_for, text
from gateway_tasks.core.settings import Settings, Tier, daily_window
from gateway_tasks.core.stats import DEFERRED_RELEASED, tier_field
from gateway_tasks.overload.actions import Action, Request, action_for, deferral_sentence
from gateway_tasks.overload.levels import Signals

logger = logging.getLogger(__name__)
HOLD = "hold"        # on_defer: hold a deferred request and release it later (the default)
REFUSE = "refuse"    # on_defer: refuse it with Deferred (retry_after_s), as a 429 over REST
ON_DEFER = (HOLD, REFUSE)


# -- time maths (pure) -----------------------------------------------------------------------
def in_window(now_ms: int, window: str, tz: str) -> bool:
    """Whether ``now_ms`` falls inside the daily window "HH:MM-HH:MM" (local time in ``tz``)."""
    span = daily_window(window) if window else None
    if span is None:
        return False
    local = datetime.fromtimestamp(now_ms / 1000, ZoneInfo(tz))
    minute = local.hour * 60 + local.minute
    start, end = span
    return start <= minute < end if start < end else (minute >= start or minute < end)


def next_window_start_ms(now_ms: int, window: str, tz: str) -> int | None:
    """When the daily window next opens after ``now_ms`` (``now_ms`` itself inside it);
    None without a window."""
    span = daily_window(window) if window else None
    if span is None:
        return None
    if in_window(now_ms, window, tz):
        return now_ms
    zone = ZoneInfo(tz)
    local = datetime.fromtimestamp(now_ms / 1000, zone)
    start = local.replace(hour=span[0] // 60, minute=span[0] % 60, second=0, microsecond=0)
    if start <= local:
        start = (start.replace(tzinfo=None) + timedelta(days=1)).replace(tzinfo=zone)
    return int(start.astimezone(timezone.utc).timestamp() * 1000)


def deferred_until_ms(now_ms: int, retry_after_s: float, off_peak: str = "", tz: str = "UTC") -> int:
    """When a task deferred at ``now_ms`` is released at the latest: after its retry time, or
    when its tier's off-peak window opens if that comes first (inside it: now)."""
    until = now_ms + int(round(retry_after_s * 1000))
    opens = next_window_start_ms(now_ms, off_peak, tz)
    return until if opens is None else min(until, opens)


# -- what the caller is told -----------------------------------------------------------------
@dataclass(frozen=True)
class Deferral:
    """A deferred request that was accepted and is held: released by ``until_ms`` at the
    latest (sooner when the level falls), ``reason`` the code, ``message`` the sentence."""

    until_ms: int
    retry_after_s: float
    reason: str
    message: str
    level: int

    @classmethod
    def of(cls, action: Action, until_ms: int, why: str = "") -> "Deferral":
        return cls(until_ms, action.retry_after_s, action.reason,
                   f"{deferral_sentence(action, why)}; held until {iso_utc(until_ms)} at the latest, "
                   f"sooner when the level falls", action.level)

    def to_json(self) -> dict[str, Any]:
        return {"deferred_until": iso_utc(self.until_ms), "deferred_until_ms": self.until_ms,
                "retry_after_s": self.retry_after_s, "reason": self.reason, "message": self.message,
                "level": self.level}


def iso_utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- Redis -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeferHoldCall:
    SCRIPT: ClassVar[str] = "overload/defer_hold"

    keys: Keys
    task_id: str
    tier: str
    send_json: str
    until_ms: int
    reason: str
    level: int
    ttl_ms: int

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(held=self.keys.held(self.task_id))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(send=self.send_json, until_ms=self.until_ms, tier=self.tier,
                                        reason=self.reason, level=self.level, ttl_ms=self.ttl_ms)

    def parse(self, reply: Any) -> int:
        return int(reply)


@dataclass(frozen=True)
class DeferReleaseCall:
    """lua/overload/defer_release.lua: one held deferred task claimed for its release (its send
    record, None when it is not held deferred any more)."""

    SCRIPT: ClassVar[str] = "overload/defer_release"

    keys: Keys
    task_id: str

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(held=self.keys.held(self.task_id))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args()

    def parse(self, reply: Any) -> dict[str, Any] | None:
        if not reply:
            return None
        try:
            return json.loads(text(reply))
        except ValueError:
            logger.error("held deferred task %s has an unreadable send record; dropped", self.task_id)
            return None


def hold(client: redis.Redis, keys: Keys, task_id: str, tier: str, pool: str, send_json: str, action: Action,
         until_ms: int, now_ms: int, result_ttl_s: int) -> None:
    """Hold a deferred task until ``until_ms``: its record (lua/overload/defer_hold.lua), then its
    place in its pool's deferred set of ``tier``."""
    ttl_ms = max(0, until_ms - now_ms) + result_ttl_s * 1000
    scripts_for(client).run(DeferHoldCall(keys, task_id, tier, send_json, until_ms, action.reason,
                                          action.level, ttl_ms))
    client.zadd(keys.deferred(pool, tier), {task_id: until_ms})


def tier_defers(settings: Settings, tier: Tier, level: int) -> bool:
    """Whether new work of ``tier`` is deferred at ``level``."""
    return action_for(settings.overload, level, tier, Request(1)).deferred


@dataclass(frozen=True)
class ReleaseReport:
    released: dict[str, int]   # tier -> tasks sent on their queue
    failed: int = 0            # released but refused by the queue (their result says why)


def release_room(signals: Signals, settings: Settings) -> dict[str, float]:
    """Per pool, the estimated tokens early releases may add this tick: one tick's worth of
    the pool's TPM below the L1 utilisation threshold, once the larger of the measured
    utilisation and the queue's backlog (as a utilisation of the next window) is counted.
    A rate, not a window's volume: released work is served over the following ticks, and
    while it is in flight neither signal sees it (pure)."""
    o = settings.overload
    room = {}
    for pool in settings.pools:
        used = max(signals.utilisation.get(pool.name, 0.0), signals.backlog_s.get(pool.name, 0.0) / o.window_s)
        room[pool.name] = max(0.0, o.utilisation_thresholds[0] - used) * pool.tpm / 60.0 * o.tick_s
    return room


def within_room(candidates: Sequence[tuple[str, str, float]], room: dict[str, float]) -> list[str]:
    """The candidates (task id, pool, estimated tokens; oldest first) released early this
    tick: in order, each while its pool's room holds it -- and the first of a pool with any
    room even if it is larger, so a large task is not held forever (pure)."""
    left, taken, out = dict(room), set(), []
    for task_id, pool, est in candidates:
        have = left.get(pool, 0.0)
        if have > 0 and (est <= have or pool not in taken):
            out.append(task_id)
            taken.add(pool)
            left[pool] = have - est
    return out


def _sizes(client: redis.Redis, keys: Keys, ids: Sequence[str]) -> list[tuple[str, str, float]]:
    """(id, pool, estimated tokens) of held tasks, from their send records ('' pool: gone)."""
    with client.pipeline(transaction=False) as pipe:
        for i in ids:
            pipe.hget(keys.held(i), "send")
        raws = pipe.execute()
    out = []
    for i, raw in zip(ids, raws):
        try:
            body = json.loads(raw)["body"] if raw else {}
            out.append((i, str(body.get("pool", "")), float(body.get("est_tokens", 0))))
        except (ValueError, KeyError, TypeError):
            out.append((i, "", 0.0))
    return out


def release_deferred(client: redis.Redis, app: Celery, settings: Settings, level: int, now_ms: int,
                     room: dict[str, float] | None = None, early: bool = True) -> ReleaseReport:
    """One tick's release of held deferred work (see the module's docstring).  ``room``: the
    pools' room for early releases (``release_room``; None = unpaced); ``early`` False: only
    what is due."""
    keys, o = Keys(settings.key_prefix), settings.overload
    budget = o.deferred_release_per_tick
    pools = [p.name for p in settings.pools]
    order = sorted(settings.tiers, key=lambda t: not in_window(now_ms, t.off_peak, o.off_peak_timezone))
    room = None if room is None else dict(room)
    opened = {t.name for t in order if early and not tier_defers(settings, t, level)}
    with client.pipeline(transaction=False) as pipe:    # one round trip: each set's due, and held
        for tier in order:
            for pool in pools:
                pipe.zrangebyscore(keys.deferred(pool, tier.name), "-inf", now_ms, start=0, num=budget,
                                   withscores=True)
                if tier.name in opened:
                    pipe.zrange(keys.deferred(pool, tier.name), 0, budget - 1, withscores=True)
        replies = iter(pipe.execute())
    found: dict[str, tuple[list[tuple[str, str]], list[tuple[str, str]]]] = {}
    for t in order:       # a tier's pools merged, oldest deferral first
        due: list[tuple[float, str, str]] = []
        held: list[tuple[float, str, str]] = []
        for pool in pools:
            due += [(score, text(i), pool) for i, score in next(replies)]
            if t.name in opened:
                held += [(score, text(i), pool) for i, score in next(replies)]
        found[t.name] = ([(i, p) for _, i, p in sorted(due)], [(i, p) for _, i, p in sorted(held)])
    released: dict[str, int] = {}
    failed = 0
    for tier in order:
        if budget <= 0:
            break
        ids, held_ids = found[tier.name]
        ids = ids[:budget]
        if held_ids and len(ids) < budget:
            due_ids = {i for i, _ in ids}
            more = [x for x in held_ids if x[0] not in due_ids]
            if room is not None and more:
                sized = [(i, pool, est) for (i, pool), (_, _, est) in zip(more, _sizes(client, keys, [i for i, _ in more]))]
                early_ids = set(within_room(sized, room))
                more = [x for x in more if x[0] in early_ids]
                for task_id, pool, est in sized:
                    if task_id in early_ids:
                        room[pool] = room.get(pool, 0.0) - est
            ids += more[:budget - len(ids)]
        if not ids:
            continue
        budget -= len(ids)
        sent, lost = _release(client, app, keys, tier.name, ids)
        if sent:
            released[tier.name] = len(sent)
        failed += lost
    return ReleaseReport(released, failed)


def release_now(client: redis.Redis, app: Celery, settings: Settings, held: Sequence[tuple[str, str]]) -> list[str]:
    """Release these tasks now if they are held deferred ((task id, tier it is held at); any
    other is left alone) -- a task a higher tier has come to wait on is judged at that tier.
    Returns the ids sent."""
    keys, by_tier = Keys(settings.key_prefix), {}
    pools = {task_id: pool for task_id, pool, _ in _sizes(client, keys, [t for t, _ in held])}
    for task_id, tier in held:
        if pools.get(task_id):
            by_tier.setdefault(tier, []).append((task_id, pools[task_id]))
    return [t for tier, ids in by_tier.items() for t in _release(client, app, keys, tier, ids)[0]]


def _release(client: redis.Redis, app: Celery, keys: Keys, tier: str,
             ids: Sequence[tuple[str, str]]) -> tuple[list[str], int]:
    """Claim ``ids`` ((task id, pool) of the tier's deferred sets; lua/overload/defer_release.lua,
    each in its task's slot), send them, then take them out of their sets: (the ids sent, how
    many the queue refused).  An id whose record is gone (cancelled, claimed by another
    worker) only leaves its set."""
    sent, failed = [], 0
    specs, _ = scripts_for(client).run_together([DeferReleaseCall(keys, task_id) for task_id, _ in ids])
    for spec in specs:
        if spec is None:
            continue
        if _send(app, client, spec):
            sent.append(spec["task_id"])
            place = split_queue_name(spec.get("queue", ""))
            if place is not None:
                client.hincrby(keys.stats(place[1]), tier_field(DEFERRED_RELEASED, place[0]), 1)
        else:
            failed += 1
    by_pool: dict[str, list[str]] = {}
    for task_id, pool in ids:
        by_pool.setdefault(pool, []).append(task_id)
    with client.pipeline(transaction=False) as pipe:
        for pool, members in by_pool.items():
            pipe.zrem(keys.deferred(pool, tier), *members)
        pipe.execute()
    return sent, failed


def _send(app: Celery, client: redis.Redis, spec: dict[str, Any]) -> bool:
    """Send a released task as the submit would have (the message lifecycle.depends.send
    sends for a task held on its dependencies); a queue that refuses it now ends it with
    that error as its result."""
    try:
        send_infer(app, client, spec["task_id"], spec["queue"], spec["body"], spec["headers"], spec["argsrepr"])
        return True
    except GatewayError as exc:
        logger.warning("deferred task %s could not be queued once released: %s", spec.get("task_id"), exc)
        app.backend.store_result(spec["task_id"], exc, "FAILURE")
        return False


def held_counts(client: redis.Redis, keys: Keys, tiers: Sequence[Tier], pools: Sequence[str]) -> dict[str, int]:
    """Per tier, the deferred tasks held now (over its pools' sets)."""
    with client.pipeline(transaction=False) as pipe:
        for t in tiers:
            for pool in pools:
                pipe.zcard(keys.deferred(pool, t.name))
        sizes = [int(n) for n in pipe.execute()]
    return {t.name: sum(sizes[k * len(pools):(k + 1) * len(pools)]) for k, t in enumerate(tiers)}
