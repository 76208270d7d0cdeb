"""The inference task: runs after pick.lua admitted it through the pool bucket.

It calls the upstream once, settles the bucket to the real usage, follows the
upstream's rate-limit headers, and on failure either requeues the message at
the front of its queue (429: the pool is drained until Retry-After; other
transient errors: while the tier's retry budget lasts) or fails with a clear
error.  A 4xx that is the caller's error (UpstreamRejected) fails at once: no
retry, no failover, nothing told to the circuit; its tokens are given back.
The result is JSON: the upstream response plus timing and tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import openai
import redis
from celery import shared_task
from celery.exceptions import Ignore, Reject

from workers.bucket import PoolBucket, retry_after_ms
from gateway_tasks.core.errors import (ConfigError, DeadlineExceeded, Expired, InvalidRequest, RetryBudgetExceeded,
                                       TaskCancelled, UpstreamError, UpstreamRejected)
from gateway_tasks.core import depends
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.request import (HEADER_DELIVERY_TAG, HEADER_DISPATCHED_MS, HEADER_ENQUEUED_MS,
                                         HEADER_EST_TOKENS, HEADER_POOL_DEBITED, HEADER_POOL_DISPATCHES,
                                         HEADER_TENANT, InferenceRequest)
from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.core.result_backend import STARTED_WITH_FIRST_TRIP, HeldStarted, take_started
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.overload_actions import degrade, record
from gateway_tasks.core.settings import MAX_LEVEL, Pool, Settings
from gateway_tasks.core.stats import COMPLETED, DEGRADED, EXPIRED, RETRIES, UPSTREAM_ERRORS, tier_field
from gateway_tasks.core.packer import connection_kwargs
from workers.circuit import READ_FIELDS, CircuitReply, PoolCircuit, closed_verdict
from workers.dead_letter import dispatched_queue, refund_unrunnable
from workers.failover import Served, fail_over
from workers.faults import AFTER_SETTLE, AFTER_UPSTREAM, kill_point
from workers.redis_retry import riding_retry, through_restarts
from workers.streaming import chat_streamed
from workers.upstream import UpstreamReply, chat, processing_ms
from workers.router import picked_stale
from workers.upstream_stats import TALLY as UPSTREAM_TIME

logger = logging.getLogger(__name__)
RESULT_HIDING_REQUEST = "workers.redaction:ResultHidingRequest"  # results stay out of task events
RETRY_BUDGET_FLOOR = 10  # retries always allowed per tier before the ratio applies
TASK_RETRIES_SPENT = "task_retries_spent"    # RetryBudgetExceeded reasons
TIER_RETRY_BUDGET_SPENT = "tier_retry_budget_spent"
CHUNKS_TTL_S = 600       # a streaming task's chunks stay readable this long


@lru_cache(maxsize=8)
def redis_for(url: str) -> redis.Redis:
    """The client of a task's own reads and writes: every command rides a Redis restart."""
    return redis.Redis.from_url(url, retry=riding_retry(), **connection_kwargs())


def _settings(task: Any) -> Settings:
    return settings_of(task.app)


def _count_failure(r: redis.Redis, keys: Keys, settings: Settings, task_id: str) -> int:
    """One more failed upstream attempt of a task (every requeue counts: 429s too); returns
    how many it has had."""
    with r.pipeline() as pipe:
        pipe.incr(keys.attempts(task_id))
        pipe.expire(keys.attempts(task_id), settings.result_ttl_s)
        return int(pipe.execute()[0])


def task_may_retry(failures: int, max_retries: int) -> bool:
    """A task that failed ``failures`` times may run again while that is within its
    tier's ``max_retries`` (so at most max_retries + 1 upstream attempts)."""
    return failures <= max_retries


def _retry_refusal(r: redis.Redis, keys: Keys, settings: Settings, req: InferenceRequest,
                   task_id: str) -> str:
    """'' when a transient failure may be requeued (counted), else the reason it may not:
    the task's own retries are spent, or its tier's budget (retry_budget_ratio of completed
    requests) that stops retry storms."""
    tier = settings.tier(req.tier)
    stats = keys.stats(req.pool)
    if not task_may_retry(_count_failure(r, keys, settings, task_id), tier.max_retries):
        return TASK_RETRIES_SPENT
    retries_field = tier_field(RETRIES, tier.name)
    retries, completed = r.hmget(stats, retries_field, tier_field(COMPLETED, tier.name))
    budget = RETRY_BUDGET_FLOOR + tier.retry_budget_ratio * int(completed or 0)
    if int(retries or 0) >= budget:
        return TIER_RETRY_BUDGET_SPENT
    r.hincrby(stats, retries_field, 1)
    return ""


def _mark_of(raw: bytes | None) -> str | None:
    """A read of a task's cancel mark: what it was when cancelled ('queued', 'running',
    'gone'), or None when it was not cancelled."""
    return raw.decode() if raw is not None else None


def _cancel_mark(r: redis.Redis, keys: Keys, task_id: str) -> str | None:
    """What a cancelled task was when it was cancelled, else None."""
    return _mark_of(r.get(keys.cancelled(task_id)))


def _cancelled_error(task_id: str, mark: str, after_call: bool = False) -> TaskCancelled:
    if after_call:
        return TaskCancelled(f"task {task_id} was cancelled while its upstream call ran; the call "
                             f"finished and its result was discarded", None, mark)
    return TaskCancelled(f"task {task_id} was cancelled ({mark}); the upstream was not called", None, mark)


QUEUE_TTL, DEADLINE = "queue_ttl", "deadline"   # Expired / DeadlineExceeded reasons


@dataclass(frozen=True)
class BeforeCall:
    """What a task reads before its upstream call, in one round trip."""
    level: int                  # the load level in force (0 when overload is off)
    gate: CircuitReply | None   # the pool's circuit verdict when it is closed; None: ask circuit.lua
    cancel_mark: str | None     # what the task was when cancelled, None if it was not
    lease_held: bool            # False: this dispatch lost its lease (the task was restored)


def holds_lease(record: bytes | None, dispatched_ms: Any) -> bool:
    """Whether the dispatched-hash record of a task's tag ('<tier>|<dispatch ms>|<entry>') is
    still this dispatch's: gone (swept and restored) or another dispatch's token, it is not (pure)."""
    if record is None:
        return False
    parts = record.split(b"|", 2)
    return len(parts) == 3 and parts[1] == str(dispatched_ms).encode()


def before_call(r: redis.Redis, keys: Keys, settings: Settings, pool: Pool, task_id: str,
                tag: str | None = None, dispatched_ms: Any = None,
                started: HeldStarted | None = None) -> BeforeCall:
    """The load level, the task's cancel mark and the pool's circuit state in one pipeline of
    plain reads.  A closed circuit's verdict is known from the read; when it is open or
    half-open the caller asks circuit.lua (``PoolCircuit.allow``: whether this call is the
    probe is its decision) once it knows the call will be made.  ``started``: the task's
    STARTED write the result backend held back (``take_started``), sent first in the same
    round trip -- or, on a failure of its own, again through the backend and its retries."""
    reads: list[tuple[str, ...]] = [("HGET", keys.overload_state, "level"), ("GET", keys.cancelled(task_id)),
                                    ("HMGET", keys.circuit(pool.name), *READ_FIELDS)]
    check_lease = isinstance(tag, str) and bool(tag) and dispatched_ms is not None
    if check_lease:
        reads.append(("HGET", keys.dispatched(pool.name), str(tag)))
    calls = []
    if started is not None:
        if started.rides_with(r):
            calls.append(started.call)
        else:
            started.send()
    scripts = scripts_for(r)
    try:
        _, got = scripts.run_together(calls, reads)
    except redis.RedisError:
        if started is None or not calls:
            raise
        started.send()   # refused (a full Redis) or cut off: the backend's retries take it over
        _, got = scripts.run_together([], reads)
    raw_level, raw_mark, raw_circuit, *raw_lease = got
    level = min(MAX_LEVEL, max(0, int(raw_level or 0))) if settings.overload.enabled else 0
    held = holds_lease(raw_lease[0], dispatched_ms) if check_lease else True
    return BeforeCall(level, closed_verdict(raw_circuit), _mark_of(raw_mark), held)


def effective_deadline_s(deadline_s: float | None, queue_ttl_s: float) -> tuple[float | None, str]:
    """The tighter of the request's deadline and the tier's queue TTL (0 = none), and which."""
    if queue_ttl_s and (not deadline_s or queue_ttl_s < deadline_s):
        return queue_ttl_s, QUEUE_TTL
    return (deadline_s or None), DEADLINE


# throws: Celery logs these failures as expected (no traceback); the task logs its own line
@shared_task(bind=True, name="gateway.infer", acks_late=True, reject_on_worker_lost=True,
             Request=RESULT_HIDING_REQUEST, throws=(UpstreamRejected,), **{STARTED_WITH_FIRST_TRIP: True})
def infer(self: Any, body: dict[str, Any]) -> dict[str, Any]:
    """One inference; when it ends (not requeued), the tasks held on it are released."""
    try:
        result = _infer(self, body)
    except (Reject, Ignore):   # requeued, or another dispatch of it runs: not finished here
        raise
    except Exception as exc:
        if isinstance(exc, UpstreamRejected):   # the upstream's words stay out: they may quote the request
            logger.warning("task %s of tenant %s: the upstream refused it with %d (type %s, code %s, "
                           "param %s); not retried", self.request.id, body.get("tenant_id"), exc.status,
                           exc.type, exc.code, exc.param)
        _finished(self, ok=False)
        raise
    _finished(self, ok=True)
    return result


DEPS_DONE = "gt_deps_done"   # on the task's request: deps_done.lua's reply from the settle round trip


def _finished(task: Any, ok: bool) -> None:
    settings = _settings(task)
    done = getattr(task.request, DEPS_DONE, None)   # marked done already, in the settle round trip
    try:
        through_restarts(lambda: depends.finish(task.app, redis_for(task.app.conf.broker_url),
                                                Keys(settings.key_prefix), settings.result_ttl_s,
                                                task.request.id, ok, done),
                         f"release of the tasks depending on {task.request.id}")
    except redis.RedisError:   # the result still stands; its dependents wait for their TTL
        logger.warning("could not release the tasks depending on %s", task.request.id, exc_info=True)


def _infer(self: Any, body: dict[str, Any]) -> dict[str, Any]:
    settings = _settings(self)
    keys = Keys(settings.key_prefix)
    r = redis_for(self.app.conf.broker_url)
    try:   # a crafted message fails here, clearly, and gives back the tokens debited for it
        req = InferenceRequest.from_body(body)
        if dispatched_queue(self.request.delivery_info) not in (None, (req.tier, req.pool)):
            raise InvalidRequest(f"task argument tier={req.tier!r} pool={req.pool!r} does not match "
                                 f"the queue it was dispatched from")
        settings.pool(req.pool)
    except (InvalidRequest, ConfigError):
        given = self.request.headers or {}
        refund_unrunnable(r, keys, settings, self.request.delivery_info,
                          {n: given.get(n, getattr(self.request, n, None))
                           for n in (HEADER_EST_TOKENS, HEADER_TENANT)})
        raise
    pool = settings.pool(req.pool)
    bucket = PoolBucket(r, keys, pool)
    headers = self.request.headers or {}
    get = lambda name: headers.get(name, getattr(self.request, name, None))  # noqa: E731
    enq_ms, disp_ms = get(HEADER_ENQUEUED_MS), get(HEADER_DISPATCHED_MS)
    est = int(get(HEADER_EST_TOKENS) or req.est_tokens)

    def refund() -> None:
        """The upstream never counted this request: give its tokens back."""
        bucket.settle(est_tokens=est, actual_tokens=0, tier=req.tier, tenant_id=req.tenant_id,
                      model=req.model, completion_tokens=0, learn=False, reached_upstream=False)

    before = before_call(r, keys, settings, pool, self.request.id, get(HEADER_DELIVERY_TAG), disp_ms,
                         started=take_started(self.request.id))
    if before.cancel_mark is not None:   # cancelled after it was taken (or put back): never call the upstream
        refund()
        raise _cancelled_error(self.request.id, before.cancel_mark)
    if not before.lease_held:
        # this worker stalled past its lease before the call (paused, starved of CPU): the sweep
        # put the task back and another dispatch runs it -- calling now would call twice.  No
        # result is stored (the other dispatch's stands); the ack is counted stale (release.lua)
        refund()
        logger.warning("task %s lost its lease before its upstream call (the task was restored and "
                       "runs elsewhere); not called", self.request.id)
        raise Ignore()

    ttl_s = settings.tier(req.tier).queue_ttl_s
    limit_s, why = effective_deadline_s(req.deadline_s, ttl_s)
    if limit_s and enq_ms and disp_ms and disp_ms > enq_ms + limit_s * 1000:
        if not picked_stale(enq_ms, disp_ms, ttl_s):   # pick.lua took its tokens: give them back
            refund()
        r.hincrby(keys.stats(pool.name), tier_field(EXPIRED, req.tier), 1)
        if why == QUEUE_TTL:
            raise Expired(f"task waited {disp_ms - enq_ms} ms, past its tier's queue TTL of {limit_s} s "
                          f"(stale); the upstream was not called", None, QUEUE_TTL)
        raise DeadlineExceeded(f"task waited {disp_ms - enq_ms} ms, past its deadline of "
                               f"{limit_s} s; the upstream was not called", None, DEADLINE)

    tier = settings.tier(req.tier)
    overload = settings.overload
    circuit = PoolCircuit(r, keys, settings.circuit, pool)
    level, gate = before.level, before.gate or circuit.allow()
    # the level may have risen since submit: degrade again (never un-degrade)
    d = degrade(overload, tier, level, req.model, req.max_tokens,
                lambda m: overload.fallback_for(m, pool.fallback_model), lambda m: m in pool.models)
    model, max_tokens = d.model, d.max_tokens
    backups = [settings.pool(n) for n in pool.backup_pools] if tier.reserved_share > 0 else []

    def call(target: Pool, target_model: str) -> UpstreamReply:
        if req.stream:   # issue 12: chunks go to the waiting API process (workers/streaming.py)
            return chat_streamed(r, keys, replace(req, model=target_model, max_tokens=max_tokens), target,
                                 self.request.id, CHUNKS_TTL_S)
        return chat(target, target_model, req.messages, max_tokens, req.extra_body, task_id=self.request.id)

    def failover(reason: str) -> Served:
        served, notes = fail_over(r, keys, settings, pool, backups, call, model=model,
                                  est_tokens=req.prompt_tokens + max_tokens, tier=req.tier,
                                  tenant_id=req.tenant_id, reason=reason)
        if served is None:
            failures = _count_failure(r, keys, settings, self.request.id)
            why = f"{reason}; no backup could take it ({', '.join(notes) or 'none configured'})"
            if not task_may_retry(failures, tier.max_retries):
                raise RetryBudgetExceeded(f"{why}; gave up after {failures} attempts", None,
                                          TASK_RETRIES_SPENT) from None
            logger.warning("pool %s: %s; requeued %s (retry %d of %d)", pool.name, why, self.request.id,
                           failures, tier.max_retries)
            raise Reject(f"{why}, requeued", requeue=True)
        return served

    started = time.monotonic()
    served: Served | None = None
    failover_reason = ""
    if not gate.may_call:
        refund()
        failover_reason = f"pool {pool.name}'s circuit is {gate.state}"
        if not backups:   # the others wait: the open circuit holds the pool's bucket
            raise Reject(f"{failover_reason}; held until it probes again", requeue=True)
        served = failover(failover_reason)
    else:
        try:
            reply = call(pool, model)
        except openai.RateLimitError as exc:
            wait = retry_after_ms(dict(exc.response.headers))
            bucket.drain(wait)
            if not gate.clean:
                circuit.success()   # the upstream answers: alive (the drain handles the 429)
            if backups:
                failover_reason = f"pool {pool.name} answered 429 (drained {wait / 1000:.1f} s)"
                served = failover(failover_reason)
            else:
                failures = _count_failure(r, keys, settings, self.request.id)
                max_retries = tier.max_retries
                if not task_may_retry(failures, max_retries):
                    raise RetryBudgetExceeded(
                        f"the upstream answered 429 to {failures} attempts of this task, its tier "
                        f"{req.tier!r} allows {max_retries} retries; retry after {wait / 1000:.1f} s",
                        wait / 1000.0, TASK_RETRIES_SPENT) from None
                mark = _cancel_mark(r, keys, self.request.id)
                if mark is not None:
                    raise _cancelled_error(self.request.id, mark)
                logger.warning("upstream 429 on pool %s: drained for %.0f ms, requeued %s (retry %d of %d)",
                               pool.name, wait, self.request.id, failures, max_retries)
                raise Reject(f"upstream 429, requeued after {wait:.0f} ms", requeue=True) from None
        except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError) as exc:
            refund()
            r.hincrby(keys.stats(pool.name), UPSTREAM_ERRORS, 1)
            circuit.failure()
            if backups:
                failover_reason = f"pool {pool.name} failed: {type(exc).__name__}"
                served = failover(failover_reason)
            else:
                mark = _cancel_mark(r, keys, self.request.id)
                if mark is not None:
                    raise _cancelled_error(self.request.id, mark)
                refusal = _retry_refusal(r, keys, settings, req, self.request.id)
                if not refusal:
                    raise Reject(f"upstream error {type(exc).__name__}, requeued", requeue=True) from None
                what = (f"this task's {tier.max_retries} retries (tier {req.tier!r}) are spent"
                        if refusal == TASK_RETRIES_SPENT else f"tier {req.tier!r}'s retry budget is spent")
                raise RetryBudgetExceeded(f"upstream failed and {what}: {exc}", None, refusal) from None
        except UpstreamRejected:   # the caller's error: says nothing of the upstream's health
            refund()
            raise
        except openai.APIStatusError as exc:
            refund()
            if not gate.clean:
                circuit.success()
            raise UpstreamError(f"upstream rejected the request ({exc.status_code}): {exc.message}") from None
        else:
            if not gate.clean or gate.verdict != "call":
                circuit.success()
    upstream_ms = (time.monotonic() - started) * 1000.0
    kill_point(AFTER_UPSTREAM)

    # one call on the pool that served it: the real usage, the reply's rate-limit headers
    # (minus what was dispatched after it), and the Redis clock; the upstream answered (and
    # charged): a Redis restart now must not drop the answer.  In the same round trip: whether
    # the task was cancelled while the call ran, and the task marked done for the tasks that
    # depend on it (deps_done.lua: failed if it was cancelled; ``_finished`` completes it)
    read_mark = [("GET", keys.cancelled(self.request.id))]
    mark_done = [depends.done_call(keys, self.request.id)]
    if served is None:
        used_pool, used_model = pool, model
        settled, (done,), (raw_mark,) = through_restarts(lambda: bucket.settle_reply_and_read(
            read_mark, mark_done, est_tokens=est, actual_tokens=reply.total_tokens, tier=req.tier, tenant_id=req.tenant_id,
            model=model, completion_tokens=reply.completion_tokens, headers=reply.headers,
            debited_tokens_at_dispatch=get(HEADER_POOL_DEBITED),
            dispatches_at_dispatch=get(HEADER_POOL_DISPATCHES)), f"settle of task {self.request.id}")
    else:
        reply, used_pool, used_model = served.reply, served.pool, served.model
        settled, (done,), (raw_mark,) = through_restarts(lambda: PoolBucket(r, keys, used_pool).settle_reply_and_read(
            read_mark, mark_done, est_tokens=served.est_tokens, actual_tokens=reply.total_tokens, tier=req.tier,
            tenant_id=req.tenant_id, model=used_model, completion_tokens=reply.completion_tokens,
            headers=reply.headers, debited_tokens_at_dispatch=served.taken.debited_tokens,
            dispatches_at_dispatch=served.taken.dispatches), f"settle of task {self.request.id}")
    setattr(self.request, DEPS_DONE, done)
    kill_point(AFTER_SETTLE)
    mark = _mark_of(raw_mark)
    if mark is not None:     # cancelled while the call ran: the tokens are spent, the result is not kept
        raise _cancelled_error(self.request.id, mark, after_call=True)
    # what was asked for: the producer's record when it changed anything, else the request
    submitted = {"requested_max_tokens": req.max_tokens, "requested_model": req.model, **(req.degradation or {})}
    requested_pool = str(submitted.get("requested_pool", req.pool))
    failover_info = None
    if served is not None:
        failover_info = {"from": pool.name, "to": used_pool.name, "reason": failover_reason,
                         "at": "dispatch"}
    elif submitted.get("failover"):
        failover_info = {"from": submitted.get("failover_from", requested_pool), "to": pool.name,
                         "reason": submitted["failover"], "at": submitted.get("failover_at", "submit")}
    changes = record(submitted, level, max_tokens=max_tokens, model=used_model, pool=used_pool.name,
                     requested_pool=requested_pool, failover=failover_info)
    if changes["max_tokens"]["capped"] or changes["model"]["substituted"]:
        r.hincrby(keys.stats(used_pool.name), tier_field(DEGRADED, req.tier), 1)
    done_ms = settled.now_ms
    UPSTREAM_TIME.add(r, keys, used_pool.name, req.tier, upstream_ms)   # issue 12: capacity model latency
    return {
        "task_id": self.request.id,
        "tenant_id": req.tenant_id,
        "tier": req.tier,
        "pool": used_pool.name,
        "model": used_model,
        "source": req.source,
        "lane": req.lane,
        "response": reply.body,
        "timing": {
            "enqueued_ms": enq_ms,
            "dispatched_ms": disp_ms,
            "completed_ms": done_ms,
            "queue_wait_ms": (disp_ms - enq_ms) if enq_ms and disp_ms else None,
            "upstream_ms": round(upstream_ms, 3),
            # the upstream's own part of it (its openai-processing-ms header; None if it sends none)
            "upstream_processing_ms": processing_ms(reply.headers),
        },
        "tokens": {
            "estimated": est,
            "estimated_prompt": req.prompt_tokens,
            "prompt": reply.prompt_tokens,
            "completion": reply.completion_tokens,
            "total": reply.total_tokens,
        },
        "overload": changes,
    }


@shared_task(name="gateway.noop", acks_late=True, reject_on_worker_lost=True,
             Request=RESULT_HIDING_REQUEST)
def noop(tag: Any = None) -> dict[str, Any]:
    """No upstream call: measures the queue itself (`gateway-dev bench` compares the
    gateway transport with plain Celery on this task).  ``started`` is the
    worker's wall clock when the task began."""
    return {"tag": tag, "started": time.time()}
