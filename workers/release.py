"""lua/release.lua as a typed call: a dispatched task is acked, dropped or put
back (front of its tenant's line), exactly once, freeing its tenant's slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.bell import BELL_MAX
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import text
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
    SCRIPT: ClassVar[str] = "release"

    keys: Keys
    settings: Settings
    pool: str
    tag: str
    mode: str = ACK
    token: str = ""      # the dispatch's token; "" releases whichever dispatch holds the tag
    expired_only: bool = False   # only if its lease has expired (sweeping a dead holder's tasks)
    bell_max: int = BELL_MAX
    # the releasing dispatcher's own bell, rung in the same call ('' = none): it waits on it
    # while only the slots it keeps for reserved work are free (workers/transport.py)
    wake: str = ""
    wake_ttl_ms: int = 10_000

    @property
    def script_keys(self) -> list[str]:
        k, p = self.keys, self.pool
        out = [k.dispatched(p), k.dispatched_at(p), k.messages(p), k.inflight(p), k.parked(p),
               k.finish(p), k.fair(p), k.stats(p)]
        for tier in self.settings.tiers:   # the tier's bell: a put-back or unparked task's wake-up
            out += [k.index(p, tier.name), k.active(p, tier.name), k.tier_bell(p, tier.name)]
        if self.wake:
            out.append(self.wake)
        return out

    @property
    def script_args(self) -> list[str | int]:
        args: list[str | int] = [self.tag, self.mode, self.bell_max, len(self.settings.tiers),
                                 self.token, STALE_RELEASES, 1 if self.expired_only else 0]
        for tier in self.settings.tiers:
            args += [tier.name, tier.max_concurrency_per_tenant, tier.scheduled_lag_tokens]
        if self.wake:
            args.append(self.wake_ttl_ms)
        return args

    def parse(self, reply: Any) -> Released:
        if int(reply[0]) == 0:
            return Released(False)
        if int(reply[0]) == 2:
            return Released(False, stale=True)
        return Released(True, text(reply[1]), text(reply[2]))


@dataclass(frozen=True)
class RenewCall:
    """lua/renew.lua: extend the leases of the tasks one dispatcher still holds."""

    SCRIPT: ClassVar[str] = "renew"

    keys: Keys
    pool: str
    held: tuple[tuple[str, str], ...]   # (delivery tag, dispatch token)
    lease_ms: int
    visibility_timeout_ms: int

    @property
    def script_keys(self) -> list[str]:
        return [self.keys.dispatched(self.pool), self.keys.dispatched_at(self.pool)]

    @property
    def script_args(self) -> list[str | int]:
        return [self.lease_ms, self.visibility_timeout_ms, *(x for pair in self.held for x in pair)]

    def parse(self, reply: Any) -> int:
        return int(reply)
