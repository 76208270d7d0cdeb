"""Python API of tenant crons: register, list, delete.

    from beat.api import register_cron, list_crons, get_cron, delete_cron
    register_cron(settings, client, "acme", "daily-digest", "0 7 * * *",
                  {"messages": [{"role": "user", "content": "Summarise yesterday"}]})

Unknown tenant -> ``UnknownTenant``; malformed cron, task id or payload ->
``CronError`` saying what is wrong; a payload a submit would refuse -> that submit's
error (``InvalidRequest``, ``PromptTooLarge``, ``RedisFull``); over the tier's cron count
or hourly fires -> ``CronLimitExceeded`` with the numbers (``beat.admission``).
"""

from __future__ import annotations

from typing import Any

import redis

from gateway_tasks.core.errors import CronError
from gateway_tasks.core.settings import Settings

from beat.entry import CronEntry
from beat.schedule import iso_utc
from beat.store import CronStore

ROW_FIELDS = ("tenant_id", "task_id", "cron", "tier", "jitter_offset_s", "nominal_next",
              "actual_next", "last_fired", "last_status", "last_task_id", "retry_at")


def cron_row(entry: CronEntry) -> dict[str, Any]:
    """The listing view of one entry (times as ISO 8601 UTC)."""
    return {
        "tenant_id": entry.tenant_id,
        "task_id": entry.task_id,
        "cron": entry.cron,
        "tier": entry.tier,
        "jitter_offset_s": entry.jitter_offset_s,
        "nominal_next": iso_utc(entry.next_nominal_ms),
        "actual_next": iso_utc(entry.next_fire_ms),
        "last_fired": iso_utc(entry.last_fire_ms),
        "last_status": entry.last_status,
        "last_task_id": entry.last_task_id,
        "retry_at": iso_utc(entry.retry_at_ms) if entry.retry_at_ms else None,
    }


def register_cron(settings: Settings, client: redis.Redis, tenant_id: str, task_id: str,
                  cron_expr: str, payload: dict[str, Any], now_ms: int | None = None,
                  gateway: Any = None) -> dict[str, Any]:
    """Create or update a tenant's cron; returns its listing row.  Admitted like a submit
    of its payload, within the tier's cron limits (``beat.admission``); ``gateway``: the
    producer to admit it through (default: one built on ``client``)."""
    return cron_row(CronStore(client, settings, gateway).add(tenant_id, task_id, cron_expr, payload,
                                                             now=now_ms))


def list_crons(settings: Settings, client: redis.Redis,
               tenant_id: str | None = None) -> list[dict[str, Any]]:
    """Rows of every cron (or one tenant's), sorted by tenant and task id."""
    return [cron_row(e) for e in CronStore(client, settings).list(tenant_id)]


def get_cron(settings: Settings, client: redis.Redis, tenant_id: str,
             task_id: str) -> dict[str, Any] | None:
    """One cron's row; None if the tenant has no cron of that id."""
    entry = CronStore(client, settings).get(tenant_id, task_id)
    return None if entry is None else cron_row(entry)


def delete_cron(settings: Settings, client: redis.Redis, tenant_id: str, task_id: str,
                missing_ok: bool = False) -> bool:
    """Delete one cron; CronError if it does not exist (False with ``missing_ok``)."""
    if not CronStore(client, settings).delete(tenant_id, task_id):
        if missing_ok:
            return False
        raise CronError(f"tenant {tenant_id!r} has no cron {task_id!r}")
    return True


def delete_tenant(settings: Settings, client: redis.Redis, tenant_id: str,
                  gateway: Any = None) -> dict[str, Any]:
    """Delete a tenant and what it owns: its registration (its key stops working, its
    generation ends: the id registered again owns nothing of this one's), its crons, and
    its unfinished tasks, cancelled with the reason (``Gateway.delete_tenant``).
    UnknownTenant if it is not registered."""
    from gateway_tasks.producer.gateway import Gateway   # lazy, as in beat.store
    gw = gateway if gateway is not None else Gateway(settings, client=client)
    gw.tenants.get(tenant_id)                            # UnknownTenant before anything changes
    crons = CronStore(client, settings, gw).delete_tenant(tenant_id)
    cancelled = gw.delete_tenant(tenant_id)
    return {"deleted": tenant_id, "crons_deleted": crons, "tasks_cancelled": cancelled}
