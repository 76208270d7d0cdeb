"""Moving queued reserved-tier tasks off a pool that cannot serve them.

Dispatch-time failover (gateway_tasks/upstream/failover.py) needs the task to be dispatched, and
a pool drained by a 429 or held by an open circuit dispatches nothing until the
block ends.  So, each controller tick, every worker looks at the pools that have
``backup_pools``: while one is blocked for at least ``MIN_BLOCK_MS`` more and a
backup is available (``gateway_tasks.upstream.health.choose_pool``), its queued
reserved-tier tasks are withdrawn (lua/upstream/withdraw.lua, atomic, journalled in the
pool's ``moving`` hash) and queued on the backup (lua/dispatch/enqueue.lua, same delivery
tag, same task id, original enqueue time), their request rewritten to the backup
pool (and its model when it lacks the requested one) with the move recorded.
A record whose mover died is handed out again after ``STALE_MS`` and queued
again (on the backup, or back on its pool): a task may then run twice, never
zero times.  Other tiers are never moved: they wait for their pool.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import redis

from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.upstream.health import PoolHealth, choose_pool, read_health
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.request import InferenceRequest
from gateway_tasks.core.scripts import Scripts, layout, scripts_for, text
from gateway_tasks.core.settings import Pool, Settings, Tier
from gateway_tasks.core.stats import RESCUED
from gateway_tasks.upstream.failover import model_on

logger = logging.getLogger(__name__)
MIN_BLOCK_MS = 500       # a shorter block is not worth a move
STALE_MS = 30_000        # a journal record this old: its mover died
BATCH = 200              # tasks moved per pool and tier per tick at most


def blocked_for_ms(health: PoolHealth) -> int:
    """How long the pool admits nothing more (drain or open circuit; 0 = it may dispatch)."""
    until = max(health.blocked_until_ms, health.open_until_ms if health.circuit == "open" else 0)
    return max(0, until - health.now_ms)


@dataclass(frozen=True)
class WithdrawCall:
    SCRIPT: ClassVar[str] = "upstream/withdraw"

    keys: Keys
    pool: str
    tier: str
    limit: int
    stale_ms: int = STALE_MS

    @property
    def script_keys(self) -> list[str]:
        k = self.keys
        return layout(self.SCRIPT).keys(index=k.index(self.pool, self.tier), messages=k.messages(self.pool),
                                        moving=k.moving(self.pool))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(tier=self.tier, limit=self.limit, stale_ms=self.stale_ms)

    def parse(self, reply: Any) -> list[dict[str, Any]]:
        return [json.loads(text(r)) for r in reply]


def rewrite_message(message: dict[str, Any], target: Pool, queue: str, reason: str) -> dict[str, Any]:
    """The kombu envelope of a gateway.infer task, re-addressed to ``target``."""
    props = message.setdefault("properties", {})
    base64_body = props.get("body_encoding") == "base64"
    raw = base64.b64decode(message["body"]) if base64_body else str(message["body"]).encode()
    args, kwargs, embed = json.loads(raw)
    req = InferenceRequest.from_body(args[0])
    before = req.degradation or {}
    degradation = {"level": before.get("level", 0), "requested_max_tokens": req.max_tokens,
                   "requested_model": req.model, **before,
                   "requested_pool": before.get("requested_pool", req.pool),
                   "failover": reason, "failover_at": "queue", "failover_from": req.pool}
    args[0] = replace(req, pool=target.name, model=model_on(target, req.model),
                      degradation=degradation).to_body()
    body = json.dumps([args, kwargs, embed]).encode()
    message["body"] = base64.b64encode(body).decode() if base64_body else body.decode()
    props.setdefault("delivery_info", {})["routing_key"] = queue
    return message


class Rescuer:
    def __init__(self, client: redis.Redis, settings: Settings, scripts: Scripts | None = None):
        self.client, self.settings = client, settings
        self.keys = Keys(settings.key_prefix)
        self.scripts = scripts or scripts_for(client)

    def _enqueue(self, tier: Tier, pool: str, entry: IndexEntry, message: dict[str, Any],
                 never_refuse: bool = False) -> bool:
        if never_refuse:   # putting a task back where it was: its place is not new demand
            tier = replace(tier, queue_max_len=sys.maxsize)
        done = enqueue(self.client, EnqueueCall(self.keys, tier, pool, tenant=entry.tenant, tag=entry.tag,
                                                est_tokens=entry.est_tokens, message_json=json.dumps(message),
                                                tenant_weight=entry.weight, enqueued_ms=entry.enqueued_ms,
                                                lane=entry.lane, count_demand=False))   # counted on arrival
        return done.accepted

    def _place(self, pool: Pool, record: dict[str, Any], target: Pool | None, reason: str) -> bool:
        """Queue one withdrawn task on ``target`` (None or refused: back on ``pool``); True if moved."""
        tier = self.settings.tier(record["tier"])
        entry = IndexEntry.decode(record["entry"])
        original = json.loads(record["message"])
        moved = False
        if target is not None:
            queue = self.settings.queue_name(tier.name, target.name)
            moved = self._enqueue(tier, target.name, entry, rewrite_message(json.loads(record["message"]),
                                                                             target, queue, reason))
        if not moved:
            self._enqueue(tier, pool.name, entry, original, never_refuse=True)
        self.client.hdel(self.keys.moving(pool.name), record["tag"])
        return moved

    def tick(self) -> int:
        """One look at every pool with backups; returns how many tasks were moved."""
        moved = 0
        for pool in self.settings.pools:
            if not pool.backup_pools:
                continue
            backups = [self.settings.pool(n) for n in pool.backup_pools]
            health = read_health(self.client, self.keys, [pool, *backups])
            blocked = blocked_for_ms(health[pool.name])
            for tier in self.settings.tiers:
                if tier.reserved_share <= 0:
                    continue
                route = choose_pool(pool, backups, health, 1, tier.max_wait_ms)
                target = route.pool if route.reason and blocked >= MIN_BLOCK_MS else None
                records = self.scripts.run(WithdrawCall(self.keys, pool.name, tier.name,
                                                        BATCH if target is not None else 0))
                for record in records:
                    moved += self._place(pool, record, target, route.reason)
            if moved:
                self.client.hincrby(self.keys.stats(pool.name), RESCUED, moved)
                logger.warning("pool %s blocked %.1f s more: moved %d queued reserved-tier tasks to %s",
                               pool.name, blocked / 1000, moved, ",".join(pool.backup_pools))
        return moved
