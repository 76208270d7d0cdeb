"""The dispatch decision: which queued message a worker takes next.

The decision itself is lua/pick.lua, run atomically in Redis so every worker
on every node shares one order.  This module builds its KEYS/ARGV from the
settings and the queues a worker consumes, and parses its answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import QUEUE_PREFIX, Keys, split_queue_name
from gateway_tasks.core.request import (HEADER_DISPATCHED_MS, HEADER_ENQUEUED_MS, HEADER_POOL_DEBITED,
                                         HEADER_POOL_DISPATCHES)
from gateway_tasks.core.scripts import text
from gateway_tasks.core.settings import Pool, Settings, Tier
from gateway_tasks.core.stats import DISPATCHED, EST_TOKENS, WAIT_MS, tier_field

@dataclass(frozen=True)
class QueueRef:
    name: str
    tier: Tier
    pool: Pool


@dataclass(frozen=True)
class Picked:
    payload: dict[str, Any]
    queue: str
    dispatched_ms: int
    est_tokens: int
    tenant: str
    tag: str
    tier: str
    pool: str
    undecodable: str = ""   # the stored message when it is not a JSON object (payload is {})


@dataclass(frozen=True)
class Wait:
    """Nothing admissible: wait_ms until a bucket refills, or -1 when all queues are empty."""

    wait_ms: int


def parse_queue_name(settings: Settings, name: str) -> QueueRef:
    """'gt.<tier>.<pool>' -> QueueRef; anything else is not a router queue."""
    parts = split_queue_name(name)
    if parts is None:
        raise ConfigError(f"queue {name!r} is not a gateway queue (expected {QUEUE_PREFIX}<tier>.<pool>)")
    return QueueRef(name, settings.tier(parts[0]), settings.pool(parts[1]))


class PickPlan:
    """pick.lua's call for one fixed set of queues: KEYS and ARGV are built once,
    every dispatch reuses them (a ``gateway_tasks.core.scripts.ScriptCall``)."""

    SCRIPT: ClassVar[str] = "pick"

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
        keys: list[str] = []
        argv: list[Any] = [settings.policy, len(pools), len(self.queues), int(settings.lease_s * 1000)]
        for pool in pools:
            p = pool.name
            keys += [k.bucket(p), k.fair(p), k.stats(p), k.messages(p), k.finish(p), k.parked(p),
                     k.inflight(p), k.dispatched(p), k.dispatched_at(p), k.depth(p)]
            argv += [*pool.rates(), pool.token_capacity * reserve_share]
        for q in self.queues:
            keys += [k.index(q.pool.name, q.tier.name), k.active(q.pool.name, q.tier.name)]
            argv += [pools.index(q.pool) + 1, q.tier.name, q.tier.base_weight,
                     q.tier.aging_alpha_per_ms, q.tier.share, q.tier.max_wait_ms,
                     1 if q.tier.reserved_share > 0 else 0, q.tier.max_concurrency_per_tenant,
                     *(tier_field(c, q.tier.name) for c in (DISPATCHED, EST_TOKENS, WAIT_MS))]
        self.bell_keys = [k.bell(pool.name) for pool in pools]  # a dispatcher's wake-up lists
        # encoded once: a dispatcher sends the same KEYS and ARGV on every poll
        self.script_keys = [k.encode() for k in keys]
        self.script_args = [str(x).encode() for x in argv]

    def parse(self, reply: Sequence[Any]) -> Picked | Wait:
        if int(reply[0]) == 0:
            return Wait(int(reply[1]))
        queue = self.queues[int(reply[2]) - 1]
        dispatched_ms, enqueued_ms = int(reply[3]), int(reply[5])
        payload, undecodable = _decoded(text(reply[1]) if reply[1] else "")
        headers = payload.setdefault("headers", {})
        if not isinstance(headers, dict):
            payload, undecodable = {"headers": {}}, text(reply[1])
            headers = payload["headers"]
        headers[HEADER_ENQUEUED_MS] = enqueued_ms
        headers[HEADER_DISPATCHED_MS] = dispatched_ms
        headers[HEADER_POOL_DEBITED] = float(text(reply[8]))
        headers[HEADER_POOL_DISPATCHES] = int(reply[9])
        return Picked(payload, queue.name, dispatched_ms, int(reply[4]), tenant=text(reply[6]),
                      tag=text(reply[7]), tier=queue.tier.name, pool=queue.pool.name,
                      undecodable=undecodable)


def _decoded(raw: str) -> tuple[dict[str, Any], str]:
    """(the message, "") or, when it is not a JSON object, ({}, the raw text): a crafted
    message must reach workers.dead_letter, not crash the dispatcher."""
    try:
        payload = json.loads(raw) if raw else {}
    except ValueError:
        return {}, raw or " "
    return (payload, "") if isinstance(payload, dict) else ({}, raw)
