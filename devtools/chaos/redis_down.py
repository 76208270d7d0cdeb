"""Fault: Redis unreachable at submit.

With Redis stopped, a Python submit must raise a clear ``GatewayError`` (not a
raw client error, not a hang) and ``POST /v1/tasks`` must answer 503 with a
JSON error; once Redis is back nothing may be half-enqueued -- no task owner
or idempotency key, no message, no depth, the bucket untouched -- and both the
API and the producer must work again by themselves.
"""

from __future__ import annotations

import time

import httpx

from gateway_tasks.core.errors import GatewayError
from devtools.chaos.counters import describe, leftovers
from devtools.chaos.deployment import POOL, Deployment
from devtools.chaos.observe import reason_of
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size, Submitter, settle

NAME = "Redis unreachable at submit (Python + REST)"
CLEAR_WITHIN_S = 10.0


def rest_submit(url: str, key: str, text: str, timeout_s: float = 30.0,
                prompt: str = "") -> tuple[int, dict, float]:
    """POST /v1/tasks (idempotency key ``text``); (status, JSON body, seconds taken)."""
    started = time.monotonic()
    try:
        resp = httpx.post(f"{url}/v1/tasks", headers={"Authorization": f"Bearer {key}"},
                          json={"messages": prompt or text, "max_tokens": 8, "idempotency_key": text},
                          timeout=timeout_s)
    except httpx.HTTPError as exc:
        return 0, {"error": {"type": type(exc).__name__}}, time.monotonic() - started
    try:
        body = resp.json()
    except ValueError:
        body = {"raw": resp.text[:200]}
    return resp.status_code, body, time.monotonic() - started


def run(size: Size) -> Outcome:
    outcome = Outcome(NAME, recovery_what="REST 202 again after Redis is back", recovery_target_s=10.0)
    with Deployment("redis-down") as dep:
        key = dep.gw.register_tenant("acme", "vip")
        _api, url = dep.api()
        dep.worker("w0")
        dep.wait_workers(1)
        bucket_before = dep.r.hgetall(dep.keys.bucket(POOL))
        dbsize_before = dep.r.dbsize()
        dep.redis_down("shutdown")

        sub = Submitter(dep)
        started = time.monotonic()
        try:
            dep.gw.submit("acme", "while Redis is down", max_tokens=8, idempotency_key="down-1")
            outcome.check("Python submit refused", False, "a submit succeeded with Redis down")
        except Exception as exc:  # noqa: BLE001
            took = time.monotonic() - started
            outcome.refused[reason_of(exc)] += 1
            clear = isinstance(exc, GatewayError) and "redis" in str(exc).lower()
            outcome.check("Python error is a clear GatewayError", clear,
                          f"got {type(exc).__module__}.{type(exc).__name__}: {str(exc)[:120]}")
            outcome.check(f"Python error within {CLEAR_WITHIN_S:g} s", took < CLEAR_WITHIN_S, f"took {took:.1f} s")
        status, body, took = rest_submit(url, key, "rest while down")
        outcome.refused[f"REST {status} {body.get('error', {}).get('type', '')}"] += 1
        outcome.check("REST 503 with a JSON error", status == 503 and "error" in body, f"got {status} {body}")
        outcome.check(f"REST answer within {CLEAR_WITHIN_S:g} s", took < CLEAR_WITHIN_S, f"took {took:.1f} s")

        dep.redis_up()
        up_at = time.monotonic()
        half = [k.decode() for k in dep.r.scan_iter(match=f"{dep.keys.prefix}task-owner:*")]
        half += [k.decode() for k in dep.r.scan_iter(match=f"{dep.keys.prefix}meta:*")]
        found = leftovers(dep.r, dep.keys, dep.settings)   # type: ignore[arg-type]
        outcome.check("nothing half-enqueued", not half and not found,
                      f"keys {half[:3]}, counters {describe(found)}")
        outcome.check("bucket untouched", dep.r.hgetall(dep.keys.bucket(POOL)) == bucket_before)
        outcome.check("no key added", dep.r.dbsize() <= dbsize_before + 2,   # + worker/event bookkeeping
                      f"{dbsize_before} -> {dep.r.dbsize()} keys")
        recovered = None
        while time.monotonic() - up_at < 30:
            status, body, _ = rest_submit(url, key, f"rest after {time.monotonic():.3f}", timeout_s=5)
            if status == 202:
                recovered = time.monotonic() - up_at
                sub.ids.append(body["task_id"])
                break
            time.sleep(0.2)
        outcome.recovery_s = recovered
        sub.many(max(2, size.tasks // 4))
        settle(dep, outcome, sub, timeout_s=60)
    return outcome
