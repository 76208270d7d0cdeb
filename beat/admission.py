"""What a cron must pass to be registered: the submit's own admission for its payload,
and the tenant's tier's limits for the cron set it joins.

Every run of a cron is a submit (``beat.fire``), so the payload is checked at
registration exactly as a submit would check it (``Gateway.admit``: JSON limits --
depth, lone surrogates, NaN/Infinity --, the Redis memory guard, the messages, a served
model, max_tokens, the token estimate against ``max_prompt_tokens`` and the pool), and
each fire goes through ``Gateway.submit`` again with the tenant's quotas.

The cron set is held to the tenant's tier (``CronLimitExceeded``, with the numbers):

* at most ``max_crons_per_tenant`` crons;
* their fires in one clock hour together (``beat.schedule.fires_per_hour`` of each) at
  most ``max_tasks_per_hour`` -- the hourly quota each fire is counted against, so a
  cron set that could not run within it is refused up front rather than skipped for
  ``quota`` every hour.
"""

from __future__ import annotations

from typing import Mapping

from gateway_tasks.core.errors import CronError
from gateway_tasks.core.settings import Tier

from beat.schedule import fires_per_hour


class CronLimitExceeded(CronError):
    """The tenant's cron set would exceed its tier's cron count or hourly fires."""

    def __init__(self, message: str, limit: str = "", allowed: int = 0, requested: int = 0):
        super().__init__(message, limit, allowed, requested)
        self.message, self.limit, self.allowed, self.requested = message, limit, allowed, requested

    def __str__(self) -> str:
        return self.message

    def details(self) -> dict[str, object]:
        """The fields a REST error body adds to type and message."""
        return {"limit": self.limit, "allowed": self.allowed, "requested": self.requested}


def check_cron_set(tier: Tier, tenant_id: str, crons: Mapping[str, str]) -> None:
    """``crons``: the tenant's cron set as it would be (task id -> expression, the new or
    updated one included).  CronLimitExceeded when the tier does not allow it."""
    if len(crons) > tier.max_crons_per_tenant:
        raise CronLimitExceeded(
            f"tenant {tenant_id!r} ({tier.name}) may register at most {tier.max_crons_per_tenant} "
            f"crons (max_crons_per_tenant); this would make {len(crons)} -- delete one first",
            "max_crons_per_tenant", tier.max_crons_per_tenant, len(crons))
    fires = sum(fires_per_hour(c) for c in crons.values())
    if fires > tier.max_tasks_per_hour:
        biggest = sorted(crons.items(), key=lambda kv: -fires_per_hour(kv[1]))[:3]
        shown = ", ".join(f"{t} {c!r} {fires_per_hour(c)}/h" for t, c in biggest)
        raise CronLimitExceeded(
            f"tenant {tenant_id!r} ({tier.name}): its {len(crons)} crons would fire up to "
            f"{fires} times in one hour, over its tier's max_tasks_per_hour of "
            f"{tier.max_tasks_per_hour} (largest: {shown})",
            "max_tasks_per_hour", tier.max_tasks_per_hour, fires)
