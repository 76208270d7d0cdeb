"""Reading a task's state from the Celery result backend: its public view,
its owner and its error (waiting for it: gateway_tasks.rest.result_waiter)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery import states

from gateway_tasks.core.errors import ApiError
from gateway_tasks.overload.deferral import iso_utc
from gateway_tasks.tenants.registry import Tenant
from gateway_tasks.producer.gateway import Gateway

def _done_ms(meta: dict[str, Any]) -> float:
    """When a stored result was written (ms since the epoch; 0 when it says nothing)."""
    done = meta.get("date_done")
    if isinstance(done, str):
        try:
            when = datetime.fromisoformat(done)
        except ValueError:
            return 0.0
        return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp() * 1000
    if isinstance(done, datetime):
        return (done if done.tzinfo else done.replace(tzinfo=timezone.utc)).timestamp() * 1000
    return 0.0


def _owner_of(meta: dict[str, Any]) -> str | None:
    """The tenant id recorded with a task's result (result body, else the task's args)."""
    result = meta.get("result")
    if isinstance(result, dict) and isinstance(result.get("tenant_id"), str):
        return result["tenant_id"]
    args = meta.get("args")
    if isinstance(args, (list, tuple)) and args and isinstance(args[0], dict):
        owner = args[0].get("tenant_id")
        return owner if isinstance(owner, str) else None
    kwargs = meta.get("kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("req"), dict):
        owner = kwargs["req"].get("tenant_id")
        return owner if isinstance(owner, str) else None
    return None


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
    """The public view of one of the tenant's tasks; ApiError 404 for an id it never
    submitted, another tenant's included (the same answer, so task ids do not leak).

    The owner is the record every submit writes (Keys.task_owner: the tenant's
    generation, ``Tenant.owner_tag``); a stored result that outlived that record is owned
    by the tenant id stored with it, if it was stored after the tenant's generation began
    (an id registered again never reads what the deleted one left).  A queued task of the
    tenant has no stored state yet: PENDING (held by the load level: with ``deferred``,
    until when at the latest and why).
    """
    owner = gateway.r.get(gateway.keys.task_owner(task_id))
    meta = gateway.app.backend.get_task_meta(task_id)
    if owner:
        mine = owner.decode() == tenant.owner_tag
    else:
        mine = _owner_of(meta) == tenant.tenant_id and _done_ms(meta) > tenant.since_ms
    if not mine:
        raise ApiError(404, "NotFound", f"no task {task_id!r} for this tenant")
    status = str(meta.get("status") or states.PENDING)
    view: dict[str, Any] = {"task_id": task_id, "status": status}
    if status == states.SUCCESS:
        view["result"] = meta.get("result")
    elif status in states.EXCEPTION_STATES:
        view["error"] = error_of(meta)
    else:
        until, reason, level = gateway.r.hmget(gateway.keys.held(task_id), "deferred_until_ms", "reason", "level")
        if until is not None:     # held by the load level: released by then at the latest
            view["deferred"] = {"deferred_until": iso_utc(int(until)), "deferred_until_ms": int(until),
                                "reason": (reason or b"").decode(), "level": int(level or 0)}
    return view
