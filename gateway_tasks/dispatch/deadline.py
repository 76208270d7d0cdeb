"""Deadline boost, Redis side: lua/dispatch/deadline.lua as a typed call.

A task submitted with ``deadline_s`` becomes urgent ``Settings.deadline_boost_s``
(seed: 60 s) before its deadline; from then on lua/dispatch/pick.lua dispatches it ahead of
its tier's fair order (promoted inside its tier, not across tiers).  A task whose
deadline is nearer than that at submit is urgent at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout

MAX_URGENT_PER_TIER = 256


def urgent_from_ms(enqueued_ms: int, deadline_s: float, boost_s: float) -> int:
    """When a task enqueued at enqueued_ms with deadline_s becomes urgent (never before it
    was enqueued)."""
    return int(enqueued_ms + max(0.0, deadline_s - boost_s) * 1000)


@dataclass(frozen=True)
class DeadlineCall:
    SCRIPT: ClassVar[str] = "dispatch/deadline"

    keys: Keys
    pool: str
    tier: str
    urgent_from_ms: int
    entry: str

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(fair=self.keys.fair(self.pool))

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(tier=self.tier, urgent_from_ms=int(self.urgent_from_ms), entry=self.entry,
                                        max_lines=MAX_URGENT_PER_TIER)

    def parse(self, reply: Any) -> bool:
        return int(reply) == 1
