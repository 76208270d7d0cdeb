"""The dispatch decision: which queued message a worker takes next.

The decision itself is lua/dispatch/pick.lua, run atomically in Redis so every worker
on every node shares one order.  This module builds its KEYS/ARGV from the
settings and the queues a worker consumes, and parses its answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Sequence

import redis

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import QUEUE_PREFIX, Keys, split_queue_name
from gateway_tasks.dispatch.request import HEADER_DISPATCH
from gateway_tasks.core.scripts import Scripts, layout, text
from gateway_tasks.core.settings import Pool, Settings, Tier
from gateway_tasks.bucket.calls import bucket_rates
from gateway_tasks.dispatch import priority
from gateway_tasks.dispatch.record import Dispatch

# larger messages are not copied through Lua: the dispatcher fetches them.  Copying one costs
# Redis less than the fetch's round trip: per task, measured (a pick's HGET against HSTRLEN and a
# second trip): 12.5 KB 32 against 70 us, 40 KB 51 against 66 us; a batch of MAX_PICKS_PER_CALL
# such messages stays a 2 MB reply
INLINE_MESSAGE_MAX_B = 64 * 1024
MAX_PICKS_PER_CALL = 32      # most tasks one pick.lua call dispatches
NO_LIMIT = -1
PICK = layout("dispatch/pick")        # pick.lua's KEYS and ARGV by name


@dataclass(frozen=True)
class QueueRef:
    name: str
    tier: Tier
    pool: Pool


@dataclass(frozen=True)
class Picked:
    """A dispatched task.  ``payload`` is None when its message was too large to come
    back inline (``INLINE_MESSAGE_MAX_B``): ``PickPlan.with_payload`` fetches it."""

    payload: dict[str, Any] | None
    queue: str
    dispatched_ms: int
    est_tokens: int
    tenant: str
    tag: str
    tier: str
    pool: str
    enqueued_ms: int = 0
    pool_debited: float = 0.0
    pool_dispatches: int = 0
    message_b: int = 0
    undecodable: str = ""   # the stored message when it is not a JSON object (payload is {})
    stale: bool = False     # past its tier's queue TTL: pick.lua took no tokens (est_tokens reads 0)

    def dispatch(self) -> Dispatch:
        """What the pick decided, as the task receives it."""
        return Dispatch(tag=self.tag, pool=self.pool, tier=self.tier, tenant=self.tenant,
                        enqueued_ms=self.enqueued_ms, dispatched_ms=self.dispatched_ms,
                        debited_tokens=0 if self.stale else self.est_tokens,
                        debited_request=not self.stale, stale=self.stale,
                        pool_debited_total=self.pool_debited, pool_dispatches_total=self.pool_dispatches)


@dataclass(frozen=True)
class Wait:
    """Nothing admissible: wait_ms until a bucket refills, or -1 when all queues are empty."""

    wait_ms: int


def picked_stale(enq_ms: int, disp_ms: int, queue_ttl_s: float) -> bool:
    """Whether a task dispatched at ``disp_ms`` waited past its tier's queue TTL, on the same
    Redis clock readings.  pick.lua dispatches such a task as stale, taking none of its
    tokens (its est_tokens reads 0), unless it is scheduled work, which never goes stale;
    the reply's parse reads both (``Picked.stale``)."""
    return queue_ttl_s > 0 and disp_ms - enq_ms > queue_ttl_s * 1000


def kept_slots(reserved_worker_slots: int, prefetch_count: int | None, serves_reserved: bool) -> int:
    """How many of a dispatcher's slots it keeps free for reserved tiers' interactive work
    (other work is picked only while more slots than this are free): the setting, when it
    serves a reserved tier, always leaving one slot for everything else; none without a
    prefetch limit (pure)."""
    if not serves_reserved or not prefetch_count or prefetch_count <= 1:
        return 0
    return max(0, min(int(reserved_worker_slots), prefetch_count - 1))


def general_picks(free: int, kept: int) -> int:
    """pick.lua's general_picks for a dispatcher with ``free`` slots keeping ``kept`` of them:
    how many of its picks may be work outside the reserve (NO_LIMIT when it keeps none)."""
    return NO_LIMIT if kept <= 0 else max(0, free - kept)


def parse_queue_name(settings: Settings, name: str) -> QueueRef:
    """'gt.<tier>.<pool>' -> QueueRef; anything else is not a router queue."""
    parts = split_queue_name(name)
    if parts is None:
        raise ConfigError(f"queue {name!r} is not a gateway queue (expected {QUEUE_PREFIX}<tier>.<pool>)")
    return QueueRef(name, settings.tier(parts[0]), settings.pool(parts[1]))


class PickPlan:
    """pick.lua's call for one fixed set of queues: KEYS and ARGV are built once,
    every dispatch reuses them (a ``gateway_tasks.core.scripts.ScriptCall``)."""

    SCRIPT: ClassVar[str] = "dispatch/pick"

    def __init__(self, settings: Settings, queue_names: Sequence[str]):
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.queues = [parse_queue_name(settings, n) for n in queue_names]
        if not self.queues:
            raise ConfigError("a dispatcher needs at least one gateway queue")
        pools: list[Pool] = []
        for q in self.queues:
            if q.pool not in pools:
                pools.append(q.pool)
        self.pools = pools
        reserve_share = max((t.reserved_share for t in settings.tiers), default=0.0)
        k = self.keys
        # pick.lua's KEYS and ARGV by name (lua/dispatch/pick.lua's header): a pool's keys and rates,
        # a queue's keys and its tier's values, one record each
        pool_records = [dict(state=k.fair(p.name), messages=k.messages(p.name), finish=k.finish(p.name),
                             parked=k.parked(p.name), inflight=k.inflight(p.name),
                             dispatched=k.dispatched(p.name), dispatched_at=k.dispatched_at(p.name),
                             **bucket_rates(p), reserve_tokens=p.token_capacity * reserve_share,
                             reserve_hold_ms=int(p.reserve_hold_s * 1000))
                        for p in pools]
        prio = priority.priorities(priority.tier_weights(settings.tiers), settings.deadline_boost_across_tiers)

        def aging(q: QueueRef) -> dict[str, float]:
            # the aging policy's terms under its preset (the other policies read the tier's own)
            weight, alpha, cap = priority.aging_terms(settings.aging, q.tier.base_weight, q.tier.aging_alpha_per_ms,
                                                      prio[q.tier.name][0])
            if settings.policy != "aging":
                weight, alpha, cap = q.tier.base_weight, q.tier.aging_alpha_per_ms, priority.NO_CAP
            return dict(base_weight=weight, alpha_per_ms=alpha, aging_cap=cap)

        queue_records = [dict(index=k.index(q.pool.name, q.tier.name), active=k.active(q.pool.name, q.tier.name),
                              bell=k.tier_bell(q.pool.name, q.tier.name),
                              pool=pools.index(q.pool) + 1, tier=q.tier.name, **aging(q), share=q.tier.share,
                              max_wait_ms=q.tier.max_wait_ms, reserved=1 if q.tier.reserved_share > 0 else 0,
                              tenant_max_inflight=q.tier.max_concurrency_per_tenant,
                              ttl_ms=int(q.tier.queue_ttl_s * 1000),   # stale: no tokens taken
                              lag_tokens=q.tier.scheduled_lag_tokens,  # gateway_tasks.dispatch.lanes
                              priority=prio[q.tier.name][0], urgent_priority=prio[q.tier.name][1])
                         for q in self.queues]
        self._named_args = dict(policy=settings.policy, lease_ms=int(settings.lease_s * 1000),
                                inline_max_b=INLINE_MESSAGE_MAX_B,
                                pool=pool_records, queue=queue_records)
        keys = PICK.keys(pool=pool_records, queue=queue_records)
        # a dispatcher's wake-up lists: its tiers' bells (arrivals) and its pools' (refunds, freed
        # tenant slots, restores): an arrival's token goes to a dispatcher that can pick it
        self.bell_keys = [*(k.tier_bell(q.pool.name, q.tier.name) for q in self.queues),
                          *(k.bell(pool.name) for pool in pools)]
        self.reserved_bell_keys = [k.reserved_bell(pool.name) for pool in pools]   # ... with kept slots only
        self.pool_bell_keys = [k.bell(pool.name) for pool in pools]   # ... and waiting for a bucket
        # encoded once: a dispatcher sends the same KEYS and ARGV on every poll
        self.script_keys = [k.encode() for k in keys]
        self.script_args = self.args(max_picks=1, general_picks=NO_LIMIT)
        # whether any queue's tier may use the pool's reserve (only then are slots kept for it)
        self.serves_reserved = any(q.tier.reserved_share > 0 for q in self.queues)
        self._batches: dict[tuple[int, int], PickBatch] = {}

    def args(self, max_picks: int, general_picks: int) -> list[bytes]:
        """pick.lua's ARGV taking up to ``max_picks`` tasks, ``general_picks`` of them outside
        the reserve (encoded once per batch: a dispatcher sends them on every poll)."""
        named = {**self._named_args, "max_picks": max_picks, "general_picks": general_picks}
        return [str(x).encode() for x in PICK.args(**named)]

    def batch(self, max_picks: int, general: int = NO_LIMIT) -> "PickBatch":
        """The same pick taking up to ``max_picks`` tasks in one call (a dispatcher with
        that many free slots), at most ``general`` of them work that may not use the reserve
        (NO_LIMIT: any; 0: only reserved tiers' interactive work); ``max_picks`` 1 is this
        plan itself, as a batch."""
        n = max(1, min(int(max_picks), MAX_PICKS_PER_CALL))
        g = NO_LIMIT if general < 0 or general >= n else int(general)
        found = self._batches.get((n, g))
        if found is None:
            found = self._batches[(n, g)] = PickBatch(self, n, g)
        return found

    def parse(self, reply: Sequence[Any]) -> Picked | Wait:
        """One pick's reply (this plan takes one task a call)."""
        got = self.parse_many(reply)
        return got[0] if isinstance(got, list) else got

    def parse_many(self, reply: Sequence[Any]) -> list[Picked] | Wait:
        n = int(reply[0])
        if n == 0:
            return Wait(int(reply[1]))
        out = []
        for i in range(2, 2 + 10 * n, 10):
            message, q, now_ms, est, enq_ms, tenant, tag, debited, dispatches, size = reply[i:i + 10]
            queue = self.queues[int(q) - 1]
            picked = Picked(None, queue.name, int(now_ms), int(est), tenant=text(tenant), tag=text(tag),
                            tier=queue.tier.name, pool=queue.pool.name, enqueued_ms=int(enq_ms),
                            pool_debited=float(text(debited)), pool_dispatches=int(dispatches),
                            message_b=int(size),
                            stale=int(est) == 0 and picked_stale(int(enq_ms), int(now_ms),
                                                                 queue.tier.queue_ttl_s))
            out.append(self.with_message(picked, message) if message else picked)
        return out

    def with_message(self, picked: Picked, message: bytes | str | None) -> Picked:
        """The picked task with its payload decoded from its message, and what the pick
        decided in its headers (``Dispatch``: one header, read back by the task)."""
        payload, undecodable = _decoded(text(message) if message else "")
        headers = payload.setdefault("headers", {})
        if not isinstance(headers, dict):
            payload, undecodable = {"headers": {}}, text(message)
            headers = payload["headers"]
        headers[HEADER_DISPATCH] = picked.dispatch().encode()
        return replace(picked, payload=payload, undecodable=undecodable)

    def with_payload(self, client: redis.Redis, picked: Picked) -> Picked:
        """A picked task whose message did not come back inline, fetched by tag."""
        if picked.payload is not None:
            return picked
        return self.with_message(picked, client.hget(self.keys.messages(picked.pool), picked.tag))


def _decoded(raw: str) -> tuple[dict[str, Any], str]:
    """(the message, "") or, when it is not a JSON object, ({}, the raw text): a crafted
    message must reach gateway_tasks.dispatch.dead_letters, not crash the dispatcher."""
    try:
        payload = json.loads(raw) if raw else {}
    except ValueError:
        return {}, raw or " "
    return (payload, "") if isinstance(payload, dict) else ({}, raw)


def pick_now(scripts: Scripts, plan: PickPlan) -> Picked | Wait:
    """One pick, its payload fetched when it did not come back inline (tools and tests;
    the workers' event loop does the same in ``gateway_tasks.dispatch.transport``)."""
    got = scripts.run(plan)
    return plan.with_payload(scripts.client, got) if isinstance(got, Picked) else got


class PickBatch:
    """pick.lua taking up to ``max_picks`` tasks in one call: a ``ScriptCall`` whose
    reply parses to the dispatched tasks in dispatch order (or a ``Wait``)."""

    SCRIPT: ClassVar[str] = "dispatch/pick"

    def __init__(self, plan: PickPlan, max_picks: int, general: int = NO_LIMIT):
        self.plan = plan
        self.max_picks = max_picks
        self.general = general
        self.script_keys = plan.script_keys
        self.script_args = plan.args(max_picks, general)

    def parse(self, reply: Sequence[Any]) -> list[Picked] | Wait:
        return self.plan.parse_many(reply)

    @staticmethod
    def rest_wait_ms(reply: Sequence[Any]) -> int:
        """After a reply that dispatched tasks: what the call's other slots face -- 0 when it
        took all it was asked for (or more may be admissible: pick again at once), else how
        long until the next admissible task, as a ``Wait`` says (-1: until a bell rings)."""
        return int(reply[1]) if int(reply[0]) > 0 else 0
