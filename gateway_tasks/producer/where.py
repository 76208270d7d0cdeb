"""Where is my task: a task's state, place in line, expected start and why it waits.

    view = task_status(gw, task_id, tenant_id)    # TaskNotFound for an id it never submitted

The view (``GET /v1/tasks/{id}``, ``gateway task show``)::

    task_id, tenant_id, status (Celery's: PENDING | STARTED | SUCCESS | FAILURE)
    state       held | queued | running | succeeded | failed | submitted (sent, not indexed yet)
    tier, lane, pool
    position    {in_tier, tier_queued, own, own_queued}: tasks ahead of it in its tier (an
                estimate under weighted fair sharing: gateway_tasks.dispatch.position) and among
                its own tenant's; queued tasks only
    expected_start  {wait_s, at_ms, rate_per_s, basis}: from the tier's measured dispatch rate
                (basis "measured": the overload controller's counter samples), else from the
                tier's share of the pool's TPM (basis "capacity")
    waiting     {reason, reasons[], ...}: why it is not running now (WAIT_REASONS)
    deferred    {deferred_until, deferred_until_ms, reason, level}: held by the load level
    cron        {entry_id, nominal_ms, jitter_offset_s}: for a cron run
    result / error, degraded {max_tokens, model, failover}: for a finished task

Everything is read, nothing written: the owner record, the task ref enqueue.lua wrote, the
tier's index (``read_spot``), the stored result.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import states

from gateway_tasks.core.errors import InvalidRequest, TaskNotFound
from gateway_tasks.dispatch.position import (Spot, capacity_rate_per_s, expected_wait_s, read_spot, tier_ahead,
                                             tier_rate_per_s)
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.lifecycle.cancel import read_refs
from gateway_tasks.overload.deferral import iso_utc
from gateway_tasks.overload.levels import tier_latency_s
from gateway_tasks.tenants.registry import TenantRegistry, tenant_of_tag

if TYPE_CHECKING:
    from gateway_tasks.producer.gateway import Gateway

# why a queued task is not running, most binding first
DEFERRED = "deferred_by_load_level"                   # held by the load level until released (deferred)
WAITING_ON_DEPENDENCIES = "waiting_on_dependencies"   # held until the tasks in depends_on finish
TENANT_AT_CAP = "tenant_at_concurrency_cap"           # its tenant runs the tier's max tasks at once
UPSTREAM_RATE_LIMITED = "upstream_rate_limited"       # the pool's bucket is drained after a 429
BUCKET_EMPTY = "pool_bucket_empty"                    # the pool's TPM bucket holds fewer tokens than it needs
TIER_SHARE = "tier_share"                             # other tiers have work queued: its tier gets its share
BEHIND_OWN = "behind_own_tasks"                       # its own tenant's earlier tasks go first
FAIR_SHARE = "fair_share_with_other_tenants"          # other tenants of its tier take their turns
NEXT = "next_in_line"                                 # nothing ahead: dispatched at the next pick
WAIT_REASONS = (DEFERRED, WAITING_ON_DEPENDENCIES, TENANT_AT_CAP, UPSTREAM_RATE_LIMITED, BUCKET_EMPTY, TIER_SHARE,
                BEHIND_OWN, FAIR_SHARE, NEXT)

CRON_RUN_PREFIX = "cron:"   # a cron run's marker (Keys.meta): 'cron:<entry id>:<nominal ms>'


def wait_reasons(spot: Spot, ahead: int, est_tokens: int, token_capacity: float, tokens_per_ms: float,
                 cap: int) -> list[str]:
    """Every reason that applies to a queued task now, most binding first (pure)."""
    reasons = []
    if spot.held:
        reasons.append(WAITING_ON_DEPENDENCIES)
    if spot.parked or (cap > 0 and spot.inflight >= cap):
        reasons.append(TENANT_AT_CAP)
    b = spot.bucket
    if b["blocked_until_ms"] > spot.now_ms:
        reasons.append(UPSTREAM_RATE_LIMITED)
    elif b["ts_ms"] > 0:
        refilled = min(token_capacity, b["tokens"] + max(0.0, spot.now_ms - b["ts_ms"]) * tokens_per_ms)
        if refilled < est_tokens:
            reasons.append(BUCKET_EMPTY)
    if any(n > 0 for n in spot.other_tiers_queued.values()):
        reasons.append(TIER_SHARE)
    if spot.own_ahead > 0:
        reasons.append(BEHIND_OWN)
    if ahead > spot.own_ahead:
        reasons.append(FAIR_SHARE)
    return reasons or [NEXT]


def cron_run(marker: bytes | None) -> tuple[str, int] | None:
    """(entry id, nominal ms) from a task's idempotency marker when it is a cron run (pure)."""
    text = marker.decode() if marker else ""
    if not text.startswith(CRON_RUN_PREFIX):
        return None
    entry_id, _, nominal = text[len(CRON_RUN_PREFIX):].rpartition(":")
    return (entry_id, int(nominal)) if entry_id and nominal.isdigit() else None


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


def _result_owner(meta: dict[str, Any]) -> str | None:
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


def degraded_of(result: dict[str, Any]) -> dict[str, Any]:
    """What the load level or a failover changed in a finished task (from the result's
    "overload" record): the capped max_tokens, the substituted model, the failover, with the
    levels at submit and dispatch; {} when nothing changed (pure)."""
    changes = result.get("overload") or {}
    if not changes.get("changed"):
        return {}
    out: dict[str, Any] = {k: changes[k] for k in ("level_at_submit", "level_at_dispatch") if k in changes}
    if (changes.get("max_tokens") or {}).get("capped"):
        out["max_tokens"] = changes["max_tokens"]
    if (changes.get("model") or {}).get("substituted"):
        out["model"] = changes["model"]
    if (changes.get("pool") or {}).get("failover"):
        out["pool"] = changes["pool"]
        if changes.get("failover"):
            out["failover"] = changes["failover"]
    return out


def task_status(gw: "Gateway", task_id: str, tenant_id: str | None = None,
                error_of: Any = None) -> dict[str, Any]:
    """The task's view (module doc).  ``tenant_id``: only that tenant's task (another's is
    ``TaskNotFound``, as an unknown id).  ``error_of``: how a failed task's stored error is
    shown (gateway_tasks.rest.results.error_of; default: its type and message)."""
    keys = gw.keys
    with gw.r.pipeline(transaction=False) as pipe:
        pipe.get(keys.task_owner(task_id))
        pipe.get(keys.meta(task_id))
        pipe.lrange(keys.overload_samples, 0, -1)
        pipe.hget(keys.overload_state, "level")
        if tenant_id is not None:
            pipe.hgetall(keys.tenant(tenant_id))
        owner_raw, marker, raw_samples, level, *record = pipe.execute()
    meta = gw.app.backend.get_task_meta(task_id)
    owner = tenant_of_tag(owner_raw.decode()) if owner_raw else _result_owner(meta)
    if tenant_id is not None and not _owns(tenant_id, record[0], owner_raw, meta):
        owner = None
    if owner is None:
        raise TaskNotFound(f"no task {task_id!r}" + (f" for tenant {tenant_id!r}" if tenant_id else ""))
    status = str(meta.get("status") or states.PENDING)
    view: dict[str, Any] = {"task_id": task_id, "tenant_id": owner, "status": status}
    run = cron_run(marker)
    if run is not None:
        entry_id, nominal_ms = run
        offset = gw.r.hget(keys.cron(entry_id), "jitter_offset_s")
        view["cron"] = {"entry_id": entry_id, "nominal_ms": nominal_ms,
                        "jitter_offset_s": int(offset) if offset is not None else None}
    if status in states.READY_STATES:
        return _finished(view, meta, error_of)
    samples = []
    for raw in raw_samples:
        try:
            samples.append(json.loads(raw))
        except ValueError:
            continue
    view["load_level"] = int(level or 0) if gw.settings.overload.enabled else 0
    return _waiting(gw, view, task_id, owner, status, samples)


def _owns(tenant_id: str, record: dict[Any, Any], owner_raw: bytes | None, meta: dict[str, Any]) -> bool:
    """Whether the tenant registered now under ``tenant_id`` submitted the task: its owner
    record names the tenant's generation (``Tenant.owner_tag``); a stored result that outlived
    that record is the tenant's if stored after its generation began."""
    if not record:
        return False
    tenant = TenantRegistry.from_record(tenant_id, record)
    if owner_raw:
        return owner_raw.decode() == tenant.owner_tag
    return _result_owner(meta) == tenant_id and _done_ms(meta) > tenant.since_ms


def _finished(view: dict[str, Any], meta: dict[str, Any], error_of: Any) -> dict[str, Any]:
    result = meta.get("result")
    if view["status"] == states.SUCCESS:
        view["state"] = "succeeded"
        if isinstance(result, dict):
            for name in ("tier", "lane", "pool", "model"):
                if name in result:
                    view[name] = result[name]
            view["timing"] = result.get("timing")
            view["degraded"] = degraded_of(result)
        view["result"] = result
    else:
        view["state"] = "failed"
        if error_of is not None:
            view["error"] = error_of(meta)
        else:
            view["error"] = {"type": type(result).__name__, "message": str(result)}
    return view


def _waiting(gw: "Gateway", view: dict[str, Any], task_id: str, owner: str, status: str,
             samples: list[Any]) -> dict[str, Any]:
    settings = gw.settings
    ref = read_refs(gw.r, gw.keys, gw._pool_names, [task_id]).get(task_id)
    if ref is None:
        with gw.r.pipeline(transaction=False) as pipe:
            pipe.exists(gw.keys.held(task_id))
            pipe.hmget(gw.keys.held(task_id), "deferred_until_ms", "reason", "level")
            held, (until, why, level) = pipe.execute()
        view["state"] = "held" if held else ("running" if status == states.STARTED else "submitted")
        if until is not None:     # held by the load level: released by then at the latest
            view["deferred"] = {"deferred_until": iso_utc(int(until)), "deferred_until_ms": int(until),
                                "reason": (why or b"").decode(), "level": int(level or 0)}
            view["waiting"] = {"reason": DEFERRED, "reasons": [DEFERRED]}
        elif held:
            view["waiting"] = {"reason": WAITING_ON_DEPENDENCIES, "reasons": [WAITING_ON_DEPENDENCIES]}
        return view
    tier, pool = settings.tier(ref.tier), settings.pool(ref.pool)
    spot = read_spot(gw.r, gw.keys, ref.pool, ref.tier, [t.name for t in settings.tiers], ref.tenant,
                     ref.entry, ref.tag, task_id)
    lane = IndexEntry.decode(ref.entry).lane if ref.entry else None
    view.update(tier=ref.tier, lane=lane, pool=ref.pool)
    if not spot.queued:
        view["state"] = "running" if (spot.dispatched or status == states.STARTED) else "submitted"
        return view
    view["state"] = "queued"
    ahead = tier_ahead(spot.own_ahead, spot.own_est, spot.own_weight, spot.others)
    view["position"] = {"in_tier": ahead, "tier_queued": spot.tier_queued, "own": spot.own_ahead,
                        "own_queued": spot.own_queued}
    rate, basis = tier_rate_per_s(samples, ref.tier), "measured"
    if not rate:
        rate, basis = capacity_rate_per_s(pool.tpm, tier.share, spot.own_est), "capacity"
    newest = max(samples, key=lambda s: int(s.get("ts_ms", 0)), default=None) if samples else None
    oldest = min(samples, key=lambda s: int(s.get("ts_ms", 0)), default=None) if samples else None
    latency = tier_latency_s(newest, oldest).get(ref.tier) if newest else None
    wait_s = expected_wait_s(ahead, rate, spot.own_ahead, tier.max_concurrency_per_tenant, latency)
    view["expected_start"] = {
        "wait_s": round(wait_s, 3) if math.isfinite(wait_s) else None,
        "at_ms": spot.now_ms + int(wait_s * 1000) if math.isfinite(wait_s) else None,
        "rate_per_s": round(rate, 3), "basis": basis}
    _, tokens_per_ms, _, _ = pool.rates()
    reasons = wait_reasons(spot, ahead, spot.own_est, pool.token_capacity, tokens_per_ms,
                           tier.max_concurrency_per_tenant)
    view["waiting"] = {"reason": reasons[0], "reasons": reasons, "tenant_inflight": spot.inflight,
                       "tenant_cap": tier.max_concurrency_per_tenant}
    return view


STATES = ("held", "queued", "running", "succeeded", "failed", "submitted")
LIST_SCAN_MAX = 5_000   # most recent tasks a state filter looks through


def list_tasks(gw: "Gateway", tenant_id: str, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """The tenant's tasks, newest first: {task_id, submitted_ms, state, status, tier?}, only
    those in ``state`` when given (one of STATES).  Three pipelined rounds of plain reads for
    the whole page (the results, where the unfinished ones sit, whether they are queued)."""
    if state is not None and state not in STATES:
        raise InvalidRequest(f"state must be one of {list(STATES)}, got {state!r}")
    scan = limit if state is None else LIST_SCAN_MAX
    rows = gw.r.zrevrange(gw.keys.tenant_tasks(tenant_id), 0, scan - 1, withscores=True)
    ids = [raw.decode() for raw, _ in rows]
    with gw.r.pipeline(transaction=False) as pipe:
        pipe.hgetall(gw.keys.tenant(tenant_id))
        for task_id in ids:
            pipe.get(gw.keys.result(task_id))
            pipe.get(gw.keys.task_owner(task_id))
        record, *got = pipe.execute()
    tag = TenantRegistry.from_record(tenant_id, record).owner_tag    # UnknownTenant when not registered
    metas, owners = got[0::2], got[1::2]
    out: dict[str, dict[str, Any]] = {}
    unfinished = []
    for (raw, score), task_id, meta, owner in zip(rows, ids, metas, owners):
        if owner is not None and owner.decode() != tag:
            continue        # an earlier generation's task (the id was deleted and registered again)
        status = states.PENDING
        item: dict[str, Any] = {"task_id": task_id, "submitted_ms": int(score)}
        if meta is not None:
            try:
                stored = json.loads(meta)
                status = str(stored.get("status") or states.PENDING)
                result = stored.get("result")
                if isinstance(result, dict) and "tier" in result:
                    item["tier"] = result["tier"]
            except ValueError:
                pass
        item["status"] = status
        if status == states.SUCCESS:
            item["state"] = "succeeded"
        elif status in states.READY_STATES:
            item["state"] = "failed"
        else:
            unfinished.append(task_id)
        out[task_id] = item
    refs = read_refs(gw.r, gw.keys, gw._pool_names, unfinished)
    with gw.r.pipeline(transaction=False) as pipe:
        for task_id in unfinished:
            ref = refs.get(task_id)
            if ref is None:
                pipe.exists(gw.keys.held(task_id))
            else:
                pipe.zscore(gw.keys.index(ref.pool, ref.tier), ref.entry or "-")
        found = pipe.execute()
    for task_id, got in zip(unfinished, found):
        item, ref = out[task_id], refs.get(task_id)
        if ref is None:
            item["state"] = "held" if got else ("running" if item["status"] == states.STARTED else "submitted")
        else:
            item["tier"] = ref.tier
            item["state"] = "queued" if got is not None else "running"
    listed = [out[t] for t in ids if t in out and (state is None or out[t]["state"] == state)]
    return listed[:limit]
