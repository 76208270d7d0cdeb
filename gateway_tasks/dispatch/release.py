"""lua/dispatch/release.lua as a typed call: a dispatched task is acked, dropped or put
back (front of its tenant's line), exactly once, freeing its tenant's slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.keys import BELL_MAX, Keys
from gateway_tasks.core.scripts import layout, text
from gateway_tasks.core.settings import Settings
from gateway_tasks.core.stats import STALE_RELEASES

ACK = "ack"          # done (acked, or rejected without requeue): forget the message
REQUEUE = "requeue"  # put it back where it was: 429, retryable error, crash, visibility timeout


@dataclass(frozen=True)
class Released:
    released: bool      # False: not released by this call (see stale)
    tenant: str = ""
    tier: str = ""
    stale: bool = False  # the tag is dispatched again under another token: this holder lost it


@dataclass(frozen=True)
class ReleaseCall:
    SCRIPT: ClassVar[str] = "dispatch/release"

    keys: Keys
    settings: Settings
    pool: str
    tag: str
    mode: str = ACK
    token: str = ""      # the dispatch's token; "" releases whichever dispatch holds the tag
    expired_only: bool = False   # only if its lease has expired (sweeping a dead holder's tasks)
    bell_max: int = BELL_MAX
    # the releasing dispatcher's own bell, rung in the same call ('' = none): it waits on it
    # while only the slots it keeps for reserved work are free (gateway_tasks/dispatch/transport.py)
    wake: str = ""
    wake_ttl_ms: int = 10_000

    @property
    def script_keys(self) -> list[str]:
        k, p = self.keys, self.pool
        return layout(self.SCRIPT).keys(
            dispatched=k.dispatched(p), dispatched_at=k.dispatched_at(p), messages=k.messages(p),
            inflight=k.inflight(p), parked=k.parked(p), finish=k.finish(p), fair=k.fair(p), stats=k.stats(p),
            # the tier's bell: a put-back or unparked task's wake-up
            tier=[dict(index=k.index(p, t.name), active=k.active(p, t.name), bell=k.tier_bell(p, t.name))
                  for t in self.settings.tiers],
            own_bell=self.wake or None)

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(
            tag=self.tag, mode=self.mode, bell_max=self.bell_max, token=self.token, stale_field=STALE_RELEASES,
            expired_only=1 if self.expired_only else 0,
            tier=[dict(name=t.name, tenant_max_inflight=t.max_concurrency_per_tenant,
                       lag_tokens=t.scheduled_lag_tokens) for t in self.settings.tiers],
            own_bell_ttl_ms=self.wake_ttl_ms if self.wake else None)

    def parse(self, reply: Any) -> Released:
        if int(reply[0]) == 0:
            return Released(False)
        if int(reply[0]) == 2:
            return Released(False, stale=True)
        return Released(True, text(reply[1]), text(reply[2]))


@dataclass(frozen=True)
class RenewCall:
    """lua/dispatch/renew.lua: extend the leases of the tasks one dispatcher still holds."""

    SCRIPT: ClassVar[str] = "dispatch/renew"

    keys: Keys
    pool: str
    held: tuple[tuple[str, str], ...]   # (delivery tag, dispatch token)
    lease_ms: int
    visibility_timeout_ms: int

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(dispatched=self.keys.dispatched(self.pool),
                                        dispatched_at=self.keys.dispatched_at(self.pool))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(lease_ms=self.lease_ms, visibility_timeout_ms=self.visibility_timeout_ms,
                                        held=[x for pair in self.held for x in pair])

    def parse(self, reply: Any) -> int:
        return int(reply)
