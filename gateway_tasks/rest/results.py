"""Reading a task's state from the Celery result backend: its public view,
its owner and its error (waiting for it: gateway_tasks.rest.result_waiter)."""

from __future__ import annotations

from typing import Any


from gateway_tasks.core.errors import ApiError, TaskNotFound
from gateway_tasks.producer.where import task_status
from gateway_tasks.tenants.registry import Tenant
from gateway_tasks.producer.gateway import Gateway


def error_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The {type, message[, reason][, retry_after_s]} of a failed task's stored exception, and
    the error's own ``details()`` (an upstream's refusal: its ``status`` and ``upstream`` error
    object); errors with a reason store (message, retry_after_s, reason) as their arguments."""
    exc = meta.get("result")
    if isinstance(exc, BaseException):
        details = getattr(exc, "details", None)
        return {"type": type(exc).__name__, "message": str(exc), **(details() if callable(details) else {})}
    if isinstance(exc, dict) and "exc_type" in exc:
        message = exc.get("exc_message")
        out: dict[str, Any] = {"type": str(exc["exc_type"])}
        if isinstance(message, (list, tuple)) and len(message) == 3 and isinstance(message[2], str) \
                and (message[1] is None or isinstance(message[1], (int, float))):
            message, retry_after_s, reason = message
            if reason:
                out["reason"] = reason
            if retry_after_s is not None:
                out["retry_after_s"] = round(float(retry_after_s), 3)
        elif isinstance(message, (list, tuple)):
            message = " ".join(str(m) for m in message)
        return {**out, "message": str(message or "")}
    return {"type": "TaskFailed", "message": str(exc) if exc is not None else ""}


def task_view(gateway: Gateway, tenant: Tenant, task_id: str) -> dict[str, Any]:
    """The public view of one of the tenant's tasks (``gateway_tasks.producer.where``: its
    state, place in line, expected start and why it waits, or its result); ApiError 404 for an
    id it never submitted, another tenant's included (the same answer, so task ids do not leak).

    The owner is the record every submit writes (Keys.task_owner: the tenant's
    generation, ``Tenant.owner_tag``); a stored result that outlived that record is owned
    by the tenant id stored with it, if it was stored after the tenant's generation began
    (an id registered again never reads what the deleted one left).  A queued task of the
    tenant has no stored state yet: PENDING (held by the load level: with ``deferred``,
    until when at the latest and why).
    """
    try:
        return task_status(gateway, task_id, tenant.tenant_id, error_of=error_of)
    except TaskNotFound:
        raise ApiError(404, "NotFound", f"no task {task_id!r} for this tenant") from None
