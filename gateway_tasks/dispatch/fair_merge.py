"""Upgrading a running deployment across the 2026-12-05 change that moved a pool's
fair-queuing state (tier virtual time, finish tags, tenant virtual times, priority
inheritance and deadline lines) into the pool's state hash beside its bucket.

Without it the old hash would simply no longer be read: tier and tenant virtual
times would restart at zero (new tenants ahead of old ones until virtual time
caught up) and boosted or deadline-urgent tasks would lose their boost.  A
worker runs ``FairMerge`` (lua/dispatch/fair_merge.lua) once per pool it consumes, before
its first pick; every later run finds no old hash and does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout


@dataclass(frozen=True)
class FairMerge:
    """lua/dispatch/fair_merge.lua for one pool: its reply is the number of fields carried over."""

    SCRIPT: ClassVar[str] = "dispatch/fair_merge"
    keys: Keys
    pool: str

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(old=self.keys.fair_before_merge(self.pool), state=self.keys.fair(self.pool))

    @property
    def script_args(self) -> list[Any]:
        return layout(self.SCRIPT).args()

    def parse(self, reply: Any) -> int:
        return int(reply)
