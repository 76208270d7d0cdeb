"""What firing a cron run does: submit its payload through the gateway.

A fire function is ``fire(entry, nominal_ms) -> task id``.  The scheduler
calls it only for runs its Lua script admitted (not already fired, within the
tenant's hourly quota).  Tests and the benchmark pass their own.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from typing import Any, Callable

from gateway_tasks.core.settings import Settings

from beat.entry import CronEntry

FireFn = Callable[[CronEntry, int], Any]


def run_key(entry_id: str, nominal_ms: int, run_secret: str) -> str:
    """The idempotency key a cron run is submitted with: one per entry and nominal time,
    the same on every beat replica (the secret is stored with the entry), so a run fired
    twice -- a deferred run tried again, two leaders for a moment -- enqueues once.  Its
    task id (uuid5 of tenant and this key, ``Submission.claim``) is unknowable without the
    entry's secret: nobody can compute another tenant's run ids in advance, and a cron
    deleted and registered again (new secret) never meets its predecessor's task ids."""
    mac = hmac.new(run_secret.encode(), f"{entry_id}|{nominal_ms}".encode(), hashlib.sha256)
    return f"cron:{mac.hexdigest()}"


def task_id_of(result: Any) -> str | None:
    """A fire function may return a task id, an AsyncResult-like object or None."""
    if result is None:
        return None
    for attr in ("id", "task_id"):
        value = getattr(result, attr, None)
        if value:
            return str(value)
    return str(result)


def _gateway(settings: Settings, app: Any, client: Any) -> Any:
    from gateway_tasks.producer.gateway import Gateway   # lazy: the producer is optional here
    kwargs = {k: v for k, v in (("app", app), ("client", client)) if v is not None}
    return Gateway(settings, **kwargs)


def gateway_fire(settings: Settings, app: Any = None, client: Any = None) -> FireFn:
    """The default fire function: ``Gateway(settings).submit(...)`` with source="cron"
    (on the given Celery app and Redis client when the scheduler has them)."""
    gateway: Any = None
    lock = threading.Lock()        # the scheduler may fire from several threads

    def fire(entry: CronEntry, nominal_ms: int) -> Any:
        nonlocal gateway
        with lock:
            if gateway is None:
                gateway = _gateway(settings, app, client)
        payload = entry.payload
        return gateway.submit(entry.tenant_id, payload["messages"], model=payload.get("model"),
                              max_tokens=payload.get("max_tokens"), source="cron",
                              idempotency_key=run_key(entry.entry_id, nominal_ms, entry.run_secret),
                              count_quota=False,   # beat counted it in the same counter
                              on_defer="refuse",   # beat retries a deferred run itself (beat.engine)
                              cron_run=(entry.entry_id, nominal_ms))

    return fire
