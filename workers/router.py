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
from gateway_tasks.core.settings import Pool, Settings, Tier
from gateway_tasks.core.stats import DISPATCHED, EST_TOKENS, WAIT_MS, tier_field

LOOKAHEAD = 8  # messages examined per queue to skip tenants at their concurrency cap


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
        keys = [self.keys.unacked, self.keys.unacked_index, self.keys.inflight]
        argv: list[Any] = [settings.policy, len(pools), len(self.queues), LOOKAHEAD]
        for pool in pools:
            keys += [self.keys.bucket(pool.name), self.keys.fair(pool.name), self.keys.stats(pool.name)]
            argv += [*pool.rates(), pool.token_capacity * reserve_share]
        for q in self.queues:
            keys.append(self.keys.queue(q.name))
            argv += [pools.index(q.pool) + 1, q.tier.name, q.tier.base_weight,
                     q.tier.aging_alpha_per_ms, q.tier.share, q.tier.max_wait_ms,
                     1 if q.tier.reserved_share > 0 else 0, q.tier.max_concurrency_per_tenant,
                     *(tier_field(c, q.tier.name) for c in (DISPATCHED, EST_TOKENS, WAIT_MS))]
        # encoded once: a dispatcher sends the same KEYS and ARGV on every poll
        self.script_keys = [k.encode() for k in keys]
        self.script_args = [str(x).encode() for x in argv]

    def parse(self, reply: Sequence[Any]) -> Picked | Wait:
        if int(reply[0]) == 0:
            return Wait(int(reply[1]))
        raw = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        payload = json.loads(raw)
        queue = self.queues[int(reply[2]) - 1].name
        dispatched_ms = int(reply[3])
        headers = payload.setdefault("headers", {})
        enq = payload.pop("gt_enq_ms", None)
        if enq is not None:
            headers["gt_enq_ms"] = enq
        headers["gt_disp_ms"] = dispatched_ms
        return Picked(payload, queue, dispatched_ms, int(reply[4]))
