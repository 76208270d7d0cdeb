"""lua/dispatch/enqueue.lua as a typed call: queue one task of a tier on a pool -- its
message into the pool's message hash, a small index entry into the tier's
index -- unless the tier's queue is full (tail drop); ring the tier's bell.

The message never passes through Lua (a prompt of 8 KB would be copied twice:
into ARGV, then into the hash): ``enqueue`` writes it with HSET and runs the
script in one MULTI, so both happen or neither does, in one round trip (``enqueue``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import redis

from gateway_tasks.core.keys import BELL_MAX, DEMAND_RETENTION_S, Keys
from gateway_tasks.core.redis_client import REDIRECTS, after_redirect, is_cluster, node_client
from gateway_tasks.dispatch.lanes import INTERACTIVE
from gateway_tasks.core.scripts import Scripts, layout, scripts_for, text
from gateway_tasks.core.settings import Tier

POOL_FULL = "pool_full"                             # QueueFull.reason: the pool's shared capacity
TIER_FULL = "tier_full"                             # QueueFull.reason: the tier's queue_max_len
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 60.0


def throttle_retry_after_s(tier: Tier) -> float:
    """When a tail-dropped or evicted task of a tier should be tried again: the tier's
    max wait, clamped to [1, 60] s."""
    return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, tier.max_wait_ms / 1000.0))


@dataclass(frozen=True)
class Enqueued:
    accepted: bool            # False: the tier's queue was at its length limit, nothing was queued
    queue_length: int         # tasks queued in the tier after the push (or when refused)
    enqueued_ms: int | None   # the Redis TIME of the enqueue (None when refused)
    pool_full: bool = False   # refused because the pool's shared queue capacity is full
    entry: str = ""           # the task's index entry (accepted): stable until it is acked


@dataclass(frozen=True)
class EnqueueCall:
    SCRIPT: ClassVar[str] = "dispatch/enqueue"

    keys: Keys
    tier: Tier
    pool: str
    tenant: str
    tag: str                # the message's delivery tag
    est_tokens: int
    message_json: str       # the kombu envelope
    tenant_weight: float = 1.0
    bell_max: int = BELL_MAX
    enqueued_ms: int | None = None   # None: now on the Redis clock (a given time: tools, tests)
    pool_capacity: int = 0           # the pool's shared queue capacity (0: none)
    pool_tiers: tuple[str, ...] = ()  # every tier of the pool: their queues count against it
    lane: str = INTERACTIVE          # gateway_tasks.dispatch.lanes: scheduled work queues behind
    task_id: str = ""                # its ref (Keys.task_ref_in) is written as it is queued ('': none)
    ref_ttl_s: int = 0
    # [capacity] counted in the demand history of the minute of ``now_s`` (this host's clock;
    # Keys.demand, read by gateway_tasks/capacity/history.py); False: the same arrival enqueued
    # again (after an eviction made room), already counted
    count_demand: bool = True
    now_s: float = field(default_factory=time.time)
    # the task-sent event published once the task is queued (a refused one sends none): its
    # channel and message (gateway_tasks.dispatch.message); '': none
    event_channel: str = ""
    event: str = ""

    @property
    def demand_hour_minute(self) -> tuple[int, int]:
        return divmod(int(self.now_s) // 60, 60)

    @property
    def script_keys(self) -> list[str]:
        k, p, t = self.keys, self.pool, self.tier.name
        return layout(self.SCRIPT).keys(
            messages=k.messages(p), index=k.index(p, t), active=k.active(p, t), finish=k.finish(p),
            parked=k.parked(p), inflight=k.inflight(p), seq=k.seq(p), fair=k.fair(p), bell=k.tier_bell(p, t),
            reserved_bell=k.reserved_bell(p), demand=k.demand(p, t, self.demand_hour_minute[0]),
            capacity_tier=[dict(index=k.index(p, tier)) for tier in self.counted_tiers],
            task_ref=k.task_ref_in(p, self.task_id) if self.task_id else None)

    @property
    def script_args(self) -> list[str | int | float]:
        return layout(self.SCRIPT).args(
            tier=self.tier.name, tenant=self.tenant, tag=self.tag, est_tokens=self.est_tokens,
            weight=self.tenant_weight, queue_max_len=self.tier.queue_max_len,
            tenant_max_inflight=self.tier.max_concurrency_per_tenant, bell_max=self.bell_max,
            enqueued_ms="" if self.enqueued_ms is None else self.enqueued_ms, pool_capacity=self.pool_capacity,
            lane=self.lane, lag_tokens=self.tier.scheduled_lag_tokens,
            reserved=1 if self.tier.reserved_share > 0 else 0, C=len(self.counted_tiers),
            message_b=self.message_b,
            demand_minute=self.demand_hour_minute[1] if self.count_demand else "",
            demand_ttl_s=DEMAND_RETENTION_S,
            ref_pool=self.pool if self.task_id else ("" if self.event_channel else None),
            ref_ttl_ms=max(1, self.ref_ttl_s) * 1000 if self.task_id else ("" if self.event_channel else None),
            event_channel=self.event_channel or None, event=self.event if self.event_channel else None)

    @property
    def counted_tiers(self) -> tuple[str, ...]:
        """The tiers whose queues the pool's shared capacity counts (none without one)."""
        return self.pool_tiers if self.pool_capacity > 0 else ()

    @property
    def message_b(self) -> int:
        """The message's size in bytes as Redis stores it (UTF-8), kept in its index entry."""
        m = self.message_json
        return len(m) if m.isascii() else len(m.encode("utf-8"))

    def parse(self, reply: Any) -> Enqueued:
        if int(reply[0]) == 0:
            return Enqueued(False, int(reply[1]), None, pool_full=len(reply) > 2)
        return Enqueued(True, int(reply[2]), int(reply[1]), entry=text(reply[3]) if len(reply) > 3 else "")


def queue_enqueue(scripts: Scripts, call: EnqueueCall, pipe: redis.client.Pipeline) -> None:
    """Add one enqueue to a MULTI pipeline (``client.pipeline(transaction=True)``): the
    message, then the script as a plain EVALSHA, loaded once per client (``Scripts.command``;
    a redis-py pipeline script would check SCRIPT EXISTS before every execute, a second round
    trip).  Its reply is ``call.parse`` of the script's result (every second result of the
    pipeline); a server that lost its scripts since answers NOSCRIPT for it (``enqueue``)."""
    pipe.hset(call.keys.messages(call.pool), call.tag, call.message_json)
    pipe.execute_command(*scripts.command(call))


def enqueue(client: redis.Redis | redis.RedisCluster, call: EnqueueCall) -> Enqueued:
    """Queue one task (message + index entry) atomically, in one round trip.  On a Redis
    Cluster the MULTI goes to the master of the pool's slot (every key of a pool shares it,
    ``core.redis_client.node_client``); a master that answers MOVED (or ASK, CLUSTERDOWN,
    TRYAGAIN: nothing ran) has the client's slot map refreshed and the enqueue sent once
    more to the slot's owner now.  A connection error refreshes the map too, and propagates.

    A server that lost its scripts since this client loaded them (restart, SCRIPT FLUSH)
    answers NOSCRIPT for the EVALSHA alone -- the HSET ran, the script did not -- so the
    script is loaded and run once more on its own: the task is queued once, its message
    written twice with the same bytes."""
    tag = call.keys.pool_tag(call.pool)
    try:
        return _enqueue_on(node_client(client, tag), call)
    except (*REDIRECTS, redis.ConnectionError) as exc:
        if not is_cluster(client):
            raise
        after_redirect(client, exc)
        if not isinstance(exc, REDIRECTS):
            raise
    return _enqueue_on(node_client(client, tag), call)


def _enqueue_on(client: redis.Redis, call: EnqueueCall) -> Enqueued:
    scripts = scripts_for(client)
    with client.pipeline(transaction=True) as pipe:
        queue_enqueue(scripts, call, pipe)
        try:
            return call.parse(pipe.execute()[1])
        except redis.exceptions.NoScriptError:
            scripts.lost()
    return scripts.run(call)
