"""Tail drop by eviction, as a typed call of lua/dispatch/evict.lua.

Each pool has a shared queue capacity (``Pool.queue_capacity``: all tiers' queued
tasks together).  When an arrival finds it full (lua/dispatch/enqueue.lua says so), the
producer evicts the newest queued task of the lowest tier below the arrival's
(VIP evicts batch first, then normal; normal evicts batch), stores the victim's
result as ``Evicted`` (a throttle reason and retry_after_s), and enqueues the
arrival.  Nothing below it queued -- a batch arrival, or a pool full of VIP work --
and the arrival fails fast with ``QueueFull`` (reason 'pool_full'): batch never
takes VIP space.  A task a higher tier's task waits on (priority inheritance,
``gateway_tasks.lifecycle.inherit``) is never the victim while that task lives.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout, text
from gateway_tasks.core.settings import Settings, Tier

EVICTED_BY_HIGHER_TIER = "evicted_by_higher_tier"   # Evicted.reason
EVICT_TRIES = 3       # evictions one arrival may make (parallel arrivals can take the room freed)


def tiers_below(settings: Settings, tier: str) -> list[Tier]:
    """The tiers an arrival of ``tier`` may evict from, lowest first."""
    rank = settings.tier_rank(tier)
    return list(reversed(settings.tiers[rank + 1:]))


@dataclass(frozen=True)
class Victim:
    tier: str
    tag: str
    task_id: str | None     # from the evicted message's headers (None: not a Celery message)
    tenant: str | None


@dataclass(frozen=True)
class EvictCall:
    SCRIPT: ClassVar[str] = "dispatch/evict"

    keys: Keys
    pool: str
    candidates: tuple[str, ...]     # tier names, lowest first
    lags: tuple[int, ...] = ()      # their scheduled lags (gateway_tasks.dispatch.lanes; none: 0)

    @property
    def script_keys(self) -> list[str]:
        k, p = self.keys, self.pool
        return layout(self.SCRIPT).keys(messages=k.messages(p), parked=k.parked(p), fair=k.fair(p), tier=[
            dict(index=k.index(p, tier), active=k.active(p, tier)) for tier in self.candidates])

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(tier=[
            dict(name=tier, lag_tokens=self.lags[i] if i < len(self.lags) else 0)
            for i, tier in enumerate(self.candidates)])

    def parse(self, reply: Any) -> Victim | None:
        if int(reply[0]) == 0:
            return None
        task_id = tenant = None
        try:
            headers = json.loads(text(reply[3])).get("headers") or {}
            task_id, tenant = headers.get("id"), headers.get("gt_tenant")
        except (ValueError, AttributeError):
            pass
        return Victim(text(reply[1]), text(reply[2]), task_id if isinstance(task_id, str) else None,
                      tenant if isinstance(tenant, str) else None)


@dataclass
class Eviction:
    """An arrival allowed to evict while it is published (``evicting``): the tiers below it,
    lowest first, their scheduled lags, and the victims the publish took for it."""

    lower: tuple[str, ...]
    lags: tuple[int, ...] = ()
    tries: int = EVICT_TRIES
    victims: list[Victim] = field(default_factory=list)
    found_none: bool = False    # evict.lua found nothing below it queued

    def may_evict(self) -> bool:
        return bool(self.lower) and not self.found_none and len(self.victims) < self.tries


_EVICTING: ContextVar[Eviction | None] = ContextVar("gt_evicting", default=None)


@contextmanager
def evicting(eviction: Eviction) -> Iterator[Eviction]:
    """Publishes in this block may evict for their arrival (the gateway channel's
    ``put_message``: a full pool evicts and enqueues again, in the same publish)."""
    token = _EVICTING.set(eviction)
    try:
        yield eviction
    finally:
        _EVICTING.reset(token)


def current_eviction() -> Eviction | None:
    return _EVICTING.get()
