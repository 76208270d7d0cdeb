"""Cancelling a task from the producer side (``Gateway.cancel``).

Queued: its index entry and message go together (lua/lifecycle/cancel.lua), so it never reaches
the upstream.  Held on its depends_on, or held as deferred by the load level: its held record
is dropped (and its place in its tier's deferred set).  Running: revoked,
and marked so the worker discards its result and no requeue or lease sweep puts it back
(the worker's own settle gives its tokens back).  A task that never runs gives its
estimate back to its tenant's TPM bucket here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from celery import states

from gateway_tasks.lifecycle.cancel import GONE, QUEUED, RUNNING, CancelCall, TaskRef, find_entry, read_refs
from gateway_tasks.core.errors import TaskCancelled, UnknownTask, UnknownTenant
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.tenants.quota import effective_tpm, tpm_settle
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.stats import CANCELLED, tier_field

if TYPE_CHECKING:
    from gateway_tasks.producer.gateway import Gateway

CANCEL_TRIES = 3      # a task caught between dispatch and requeue is looked for again
ALREADY_CANCELLED, FINISHED, WAITING, DEFERRED = "already_cancelled", "finished", "waiting", "deferred"
MESSAGES = {QUEUED: "cancelled while queued; it never reached the upstream",
            RUNNING: "cancelled while running; it was revoked and its result is discarded",
            GONE: "cancelled before it was queued or after it was lost; it will not run"}


@dataclass(frozen=True)
class Cancelled:
    """What ``Gateway.cancel`` did: ``was`` is 'queued' (removed: it never reaches the
    upstream), 'waiting' (held on its depends_on: dropped), 'deferred' (held by the load level:
    dropped), 'running' (revoked: a call in
    flight finishes and its result is discarded),
    'gone' (neither queued nor running yet -- being published, or lost -- marked so it never
    runs), 'already_cancelled', or 'finished' (nothing to cancel: ``status`` says how it ended)."""

    task_id: str
    was: str
    status: str

    @property
    def cancelled(self) -> bool:
        return self.was != FINISHED


def cancel_task(gw: "Gateway", task_id: str, tenant_id: str | None = None, why: str = "") -> Cancelled:
    known = gw.owner(task_id) is not None if tenant_id is None else gw.owns(tenant_id, task_id)
    if not known:
        raise UnknownTask(f"no task {task_id!r}" + (f" for tenant {tenant_id!r}" if tenant_id else ""))
    if gw.r.exists(gw.keys.cancelled(task_id)):
        return Cancelled(task_id, ALREADY_CANCELLED, states.FAILURE)
    status = _status(gw, task_id)
    if status in states.READY_STATES:
        return Cancelled(task_id, FINISHED, status)
    held = _drop_held(gw, task_id)
    if held:     # held on its depends_on, or deferred: never queued
        gw.r.set(gw.keys.cancelled(task_id), held, ex=gw.settings.result_ttl_s)
        where = ("while the load level held it deferred" if held == DEFERRED else "while it waited on its depends_on")
        _store_cancelled(gw, task_id, held, f"cancelled {where}; it was never queued" + why)
        return Cancelled(task_id, held, states.FAILURE)
    ref = read_refs(gw.r, gw.keys, gw._pool_names, [task_id]).get(task_id)
    was, entry = GONE, ""
    if ref is not None:
        lag = next((t.scheduled_lag_tokens for t in gw.settings.tiers if t.name == ref.tier), 0)
        for _ in range(CANCEL_TRIES):
            entry = find_entry(gw.r, gw.keys, ref)
            was = scripts_for(gw.r).run(CancelCall(gw.keys, task_id, ref, entry, lag))
            if was != GONE or _status(gw, task_id) in states.READY_STATES:
                break
    if was == GONE:
        status = _status(gw, task_id)
        if status in states.READY_STATES:
            return Cancelled(task_id, FINISHED, status)
    # the mark, in the task's own slot, once cancel.lua (its pool's slot) has done its part
    gw.r.set(gw.keys.cancelled(task_id), was, ex=gw.settings.result_ttl_s)
    if was in (QUEUED, RUNNING):
        gw.r.hincrby(gw.keys.stats(ref.pool), tier_field(CANCELLED, ref.tier), 1)
    if was == QUEUED and entry:
        _give_back_queued(gw, ref, entry)
    if was == RUNNING:
        gw.app.control.revoke(task_id)
    _store_cancelled(gw, task_id, was, MESSAGES[was] + why)
    return Cancelled(task_id, was, states.FAILURE)


def _drop_held(gw: "Gateway", task_id: str) -> str:
    """Drop a held task, its TPM tokens given back: WAITING (it was held on its depends_on),
    DEFERRED (held by the load level), '' (it was not held)."""
    key = gw.keys.held(task_id)
    with gw.r.pipeline(transaction=True) as pipe:     # one key: its task's slot
        pipe.hmget(key, "send", "tier", "deferred_until_ms")
        pipe.delete(key)
        (spec, tier, until), dropped = pipe.execute()
    if not dropped:
        return ""
    try:
        body = json.loads(spec)["body"] if spec else {}
    except (ValueError, KeyError, TypeError):
        body = {}
    deferred_tier = tier if until is not None else None     # a deferral's record says until when
    if deferred_tier and isinstance(body.get("pool"), str):  # its place in the pool's deferred set
        gw.r.zrem(gw.keys.deferred(body["pool"], deferred_tier.decode()), task_id)
    tenant, est, tpm = body.get("tenant_id"), body.get("est_tokens"), body.get("tenant_tpm")
    if isinstance(tenant, str) and isinstance(est, int) and isinstance(tpm, int) and tpm > 0 and est > 0:
        scripts_for(gw.r).run(tpm_settle(gw.keys, tenant, est, tpm))
    return DEFERRED if deferred_tier else WAITING


def _give_back_queued(gw: "Gateway", ref: TaskRef, entry: str) -> None:
    """A task removed while queued never runs: its estimate goes back to its tenant's TPM
    bucket (the tenant's quota now: the bucket is capped at it)."""
    try:
        tenant = gw.tenants.get(ref.tenant)
        est = IndexEntry.decode(entry).est_tokens
    except (UnknownTenant, ValueError):
        return
    tpm = effective_tpm(tenant.tpm, gw.settings.tier(tenant.tier).tenant_tpm)
    if tpm > 0 and est > 0:
        scripts_for(gw.r).run(tpm_settle(gw.keys, ref.tenant, est, tpm))


def _store_cancelled(gw: "Gateway", task_id: str, was: str, message: str) -> None:
    gw.app.backend.store_result(task_id, TaskCancelled(f"task {task_id} {message}", None, was), states.FAILURE)
    gw._finished(task_id)


def _status(gw: "Gateway", task_id: str) -> str:
    return str(gw.app.backend.get_task_meta(task_id).get("status") or states.PENDING)
