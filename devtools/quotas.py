"""Settings for load tools: the tenants' hourly quotas and the tiers' queue TTLs lifted.

The seed's defaults (10 / 60 / 500 tasks per hour for batch / normal / vip, VIP work
stale after 15 s) are right for a deployment and wrong for a benchmark or the demo,
which push thousands of tasks per tenant through a deliberately overloaded upstream
to measure the router: those tools run on ``for_load(settings)``.
"""

from __future__ import annotations

from dataclasses import replace

from gateway_tasks.core.settings import Settings

LOAD_TASKS_PER_HOUR = 1_000_000_000


def for_load(settings: Settings) -> Settings:
    """The settings with every tier's max_tasks_per_hour lifted and its queue TTL off."""
    return settings.with_(tiers=tuple(replace(t, max_tasks_per_hour=LOAD_TASKS_PER_HOUR, queue_ttl_s=0.0)
                                      for t in settings.tiers))
