"""lua/release.lua as a typed call: a dispatched task is acked, dropped or put
back (front of its tenant's line), exactly once, freeing its tenant's slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.bell import BELL_MAX
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import text
from gateway_tasks.core.settings import Settings

ACK = "ack"          # done (acked, or rejected without requeue): forget the message
REQUEUE = "requeue"  # put it back where it was: 429, retryable error, crash, visibility timeout


@dataclass(frozen=True)
class Released:
    released: bool      # False: the tag was not dispatched (already released by someone)
    tenant: str = ""
    tier: str = ""


@dataclass(frozen=True)
class ReleaseCall:
    SCRIPT: ClassVar[str] = "release"

    keys: Keys
    settings: Settings
    pool: str
    tag: str
    mode: str = ACK
    bell_max: int = BELL_MAX

    @property
    def script_keys(self) -> list[str]:
        k, p = self.keys, self.pool
        out = [k.dispatched(p), k.dispatched_at(p), k.messages(p), k.inflight(p), k.parked(p),
               k.finish(p), k.fair(p), k.depth(p), k.bell(p)]
        for tier in self.settings.tiers:
            out += [k.index(p, tier.name), k.active(p, tier.name)]
        return out

    @property
    def script_args(self) -> list[str | int]:
        args: list[str | int] = [self.tag, self.mode, self.bell_max, len(self.settings.tiers)]
        for tier in self.settings.tiers:
            args += [tier.name, tier.max_concurrency_per_tenant]
        return args

    def parse(self, reply: Any) -> Released:
        if int(reply[0]) == 0:
            return Released(False)
        return Released(True, text(reply[1]), text(reply[2]))
