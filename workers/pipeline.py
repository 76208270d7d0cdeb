"""The inference task as a pipeline of named stages, typed records between them.

    job        = Job.of(task)             settings, Redis, the dispatch record, the reservation
    request    = parse(job, body)         the task argument, checked against its dispatch
    admitted   = admit(job, request)      cancelled? lease lost? past its queue TTL / deadline?
                                          the load level's degradation, the circuit's gate
    outcome    = call(job, admitted)      the upstream, through the circuit and failover:
                                          Called, or Stopped (the error the task ends with,
                                          or a requeue)
    settlement = settle(job, outcome)     the one place what was reserved and not used goes back
    result(job, outcome, settlement)      the JSON result, or the outcome's error raised

A streaming task runs the same stages; only the upstream call differs (``_upstream``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import openai
import redis
from celery.exceptions import Ignore, Reject

from gateway_tasks.lifecycle import depends
from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.upstream.chunks import ChunkWriter
from gateway_tasks.core.errors import (ConfigError, DeadlineExceeded, Expired, InvalidRequest, RetryBudgetExceeded,
                                       TaskCancelled, UpstreamError, UpstreamRejected)
from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.actions import degrade, record
from gateway_tasks.core.redis_client import Client, connect
from gateway_tasks.dispatch.lanes import SCHEDULED
from gateway_tasks.dispatch.request import CHAT, EMBEDDINGS, InferenceRequest
from gateway_tasks.core.result_backend import HeldStarted, take_started
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import MAX_LEVEL, Pool, Settings, Tier
from gateway_tasks.core.stats import COMPLETED, DEGRADED, EXPIRED, RETRIES, UPSTREAM_ERRORS, tier_field
from gateway_tasks.bucket.pool_bucket import PoolBucket, retry_after_ms
from gateway_tasks.upstream.circuit import PROBE, READ_FIELDS, CircuitReply, PoolCircuit, closed_verdict
from gateway_tasks.dispatch.record import Dispatch
from gateway_tasks.upstream.failover import TRANSIENT, fail_over
from gateway_tasks.core.faults import AFTER_SETTLE, AFTER_UPSTREAM, kill_point
from gateway_tasks.core.redis_retry import riding_retry, through_restarts
from gateway_tasks.upstream.reservation import Debit, Reservation, Settlement, Used
from gateway_tasks.upstream.streaming import chat_streamed
from gateway_tasks.upstream.client import UpstreamReply, chat, embed, processing_ms
from gateway_tasks.upstream.stats import TALLY as UPSTREAM_TIME
from gateway_tasks.usage import counters as usage

logger = logging.getLogger(__name__)
RETRY_BUDGET_FLOOR = 10  # retries always allowed per tier before the ratio applies
TASK_RETRIES_SPENT = "task_retries_spent"    # RetryBudgetExceeded reasons
TIER_RETRY_BUDGET_SPENT = "tier_retry_budget_spent"
CHUNKS_TTL_S = 600       # a streaming task's chunks stay readable this long
QUEUE_TTL, DEADLINE = "queue_ttl", "deadline"   # Expired / DeadlineExceeded reasons
DEPS_DONE = "gt_deps_done"   # on the task's request: deps_done.lua's reply from the settle round trip


@lru_cache(maxsize=8)
def redis_for(url: str) -> Client:
    """The client of a task's own reads and writes (the deployment's Redis, a cluster client
    on a Redis Cluster): every command rides a Redis restart."""
    return connect(url, retry=riding_retry())


# -- the records between the stages ---------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One run of the task: where it runs, what the pick decided, what it holds."""

    task_id: str
    request: Any                 # Celery's request of the running task
    settings: Settings
    keys: Keys
    r: redis.Redis
    dispatch: Dispatch | None    # None: the message did not come through pick.lua
    reservation: Reservation
    usage: dict[str, int] = field(default_factory=dict)   # the tenant's usage counted by this run

    @classmethod
    def of(cls, task: Any) -> "Job":
        settings = settings_of(task.app)
        keys = Keys(settings.key_prefix)
        r = redis_for(settings.redis_url)
        dispatch = Dispatch.of_request(task.request)
        reservation = Reservation(r, keys, dispatch.tier if dispatch else "", dispatch.tenant if dispatch else "")
        if dispatch is not None:
            try:
                pool = settings.pool(dispatch.pool)
            except ConfigError:      # a pool this worker does not know: nothing of it to give back
                pass
            else:
                reservation.hold(Debit(pool, dispatch.debited_tokens, dispatch.debited_request,
                                       dispatch.pool_debited_total, dispatch.pool_dispatches_total))
        return cls(task.request.id, task.request, settings, keys, r, dispatch, reservation)


@dataclass(frozen=True)
class Admitted:
    """A task cleared to call: its pool, the load level's changes, the circuit's gate."""

    req: InferenceRequest
    pool: Pool
    tier: Tier
    level: int                   # the load level in force
    model: str                   # after the level's degradation (never un-degraded)
    max_tokens: int
    circuit: PoolCircuit
    gate: CircuitReply
    backups: tuple[Pool, ...]    # the pool's backups, for a reserved tier (else none)


@dataclass(frozen=True)
class Called:
    """The upstream answered: the call that served the task."""

    admitted: Admitted
    used: Used
    upstream_ms: float
    failover_reason: str         # '' when its own pool served it


@dataclass(frozen=True)
class Stopped:
    """The task stops without a served call: ``error`` is raised once its reservation is
    settled.  A GatewayError ends the task; Celery's Reject (requeue) and Ignore (another
    dispatch runs it) do not -- it runs again, keeping its tenant's tokens."""

    error: BaseException
    req: InferenceRequest | None

    @property
    def ends(self) -> bool:
        return not isinstance(self.error, (Reject, Ignore))


Outcome = Called | Stopped


# -- the driver -----------------------------------------------------------------------------
def run(task: Any, body: Any) -> dict[str, Any]:
    """The inference task, stage by stage."""
    job = Job.of(task)
    outcome = attempt(job, body)
    settlement = settle(job, outcome)
    return result(job, outcome, settlement)


def attempt(job: Job, body: Any) -> Outcome:
    """parse -> admit -> call; whatever stops the task becomes its outcome (``Stopped``)."""
    req = None
    try:
        req = parse(job, body)
        called = call(job, admit(job, req))
    except Exception as exc:   # noqa: BLE001 -- raised again by ``result``, after the settle
        return Stopped(exc, req)
    kill_point(AFTER_UPSTREAM)
    return called


# -- parse ----------------------------------------------------------------------------------
def parse(job: Job, body: Any) -> InferenceRequest:
    """The task argument, checked (a crafted message fails here, clearly), and against the
    queue it was dispatched from."""
    req = InferenceRequest.from_body(body)
    d = job.dispatch
    if d is not None and (d.tier, d.pool) != (req.tier, req.pool):
        raise InvalidRequest(f"task argument tier={req.tier!r} pool={req.pool!r} does not match "
                             f"the queue it was dispatched from")
    job.settings.pool(req.pool)
    job.reservation.tier, job.reservation.tenant_id = req.tier, req.tenant_id
    job.reservation.hold_tenant_tokens(req.est_tokens, req.tenant_tpm)
    return req


# -- admit ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BeforeCall:
    """What a task reads before its upstream call, in one round trip."""
    level: int                  # the load level in force (0 when overload is off)
    gate: CircuitReply | None   # the pool's circuit verdict when it is closed; None: ask circuit.lua
    cancel_mark: str | None     # what the task was when cancelled, None if it was not
    lease_held: bool            # False: this dispatch lost its lease (the task was restored)


def admit(job: Job, req: InferenceRequest) -> Admitted:
    """The checks before the call: cancelled, lease lost, waited past its queue TTL or
    deadline; then the load level's degradation and the circuit's gate."""
    settings, d = job.settings, job.dispatch
    pool, tier = settings.pool(req.pool), settings.tier(req.tier)
    before = before_call(job.r, job.keys, settings, pool, job.task_id, d.tag if d else None,
                         d.dispatched_ms if d else None, started=take_started(job.task_id))
    if before.cancel_mark is not None:   # cancelled after it was taken (or put back): never call the upstream
        raise _cancelled_error(job.task_id, before.cancel_mark)
    if not before.lease_held:
        # this worker stalled past its lease before the call (paused, starved of CPU): the sweep
        # put the task back and another dispatch runs it -- calling now would call twice.  No
        # result is stored (the other dispatch's stands); the ack is counted stale (release.lua)
        logger.warning("task %s lost its lease before its upstream call (the task was restored and "
                       "runs elsewhere); not called", job.task_id)
        raise Ignore()
    _check_wait(job, req, tier, pool)
    circuit = PoolCircuit(job.r, job.keys, settings.circuit, pool)
    gate = before.gate or circuit.allow()
    overload = settings.overload
    # the level may have risen since submit: degrade again (never un-degrade)
    judged = settings.tier(req.effective_tier) if req.effective_tier else tier   # on behalf of a higher tier
    if req.endpoint != CHAT:     # an embedding is never degraded (no max_tokens, no fallback model)
        judged = replace(judged, can_degrade=False)
    changed = degrade(overload, judged, before.level, req.model, req.max_tokens,
                      lambda m: overload.fallback_for(m, pool.fallback_model), lambda m: m in pool.models,
                      at_dispatch=True)
    backups = tuple(settings.pool(n) for n in pool.backup_pools) if tier.reserved_share > 0 else ()
    return Admitted(req, pool, tier, before.level, changed.model, changed.max_tokens, circuit, gate, backups)


def _check_wait(job: Job, req: InferenceRequest, tier: Tier, pool: Pool) -> None:
    """Expired / DeadlineExceeded when the task waited past the tighter of its tier's queue
    TTL and its deadline."""
    d = job.dispatch
    # scheduled work never goes stale (pick.lua's mark_stale): only its own deadline applies
    limit_s, why = effective_deadline_s(req.deadline_s, 0.0 if req.lane == SCHEDULED else tier.queue_ttl_s)
    if not (limit_s and d and d.enqueued_ms and d.dispatched_ms and d.queue_wait_ms > limit_s * 1000):
        return
    job.r.hincrby(job.keys.stats(pool.name), tier_field(EXPIRED, req.tier), 1)
    job.usage[usage.EXPIRED] = 1
    if why == QUEUE_TTL:
        raise Expired(f"task waited {d.queue_wait_ms} ms, past its tier's queue TTL of {limit_s} s "
                      f"(stale); the upstream was not called", None, QUEUE_TTL)
    raise DeadlineExceeded(f"task waited {d.queue_wait_ms} ms, past its deadline of "
                           f"{limit_s} s; the upstream was not called", None, DEADLINE)


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


# -- call -----------------------------------------------------------------------------------
def call(job: Job, a: Admitted) -> Called:
    """The upstream call on the task's pool, through its circuit; a reserved tier fails over
    to a backup when the pool cannot serve it.  Anything else that stops the task is raised:
    a 429 or a transient failure requeues (``Reject``) while retries last."""
    started = time.monotonic()
    if not a.gate.may_call:
        reason = f"pool {a.pool.name}'s circuit is {a.gate.state}"
        if not a.backups:   # the others wait: the open circuit holds the pool's bucket
            raise Reject(f"{reason}; held until it probes again", requeue=True)
        return _failed_over(job, a, reason, started)
    try:
        reply = _upstream(job, a, a.pool, a.model)
    except openai.RateLimitError as exc:
        job.usage[usage.ABSORBED_429] = job.usage.get(usage.ABSORBED_429, 0) + 1
        wait_ms = retry_after_ms(dict(exc.response.headers))
        debit = job.reservation.debit_on(a.pool)
        est = debit.tokens if debit else a.req.prompt_tokens + a.max_tokens
        PoolBucket(job.r, job.keys, a.pool).drain(wait_ms, est)
        job.reservation.drained(a.pool)
        if not a.gate.clean:
            a.circuit.success()   # the upstream answers: alive (the drain handles the 429)
        if a.backups:
            return _failed_over(job, a, f"pool {a.pool.name} answered 429 (drained {wait_ms / 1000:.1f} s)",
                                started)
        _requeue_after_429(job, a, wait_ms)
    except TRANSIENT as exc:
        job.r.hincrby(job.keys.stats(a.pool.name), UPSTREAM_ERRORS, 1)
        a.circuit.failure()
        if a.backups:
            return _failed_over(job, a, f"pool {a.pool.name} failed: {type(exc).__name__}", started)
        _requeue_after_error(job, a, exc)
    except UpstreamRejected:   # the caller's error: says nothing of the upstream's health ...
        if a.gate.verdict == PROBE:
            a.circuit.success()   # ... but it answered: a half-open probe succeeded
        raise
    except openai.APIStatusError as exc:
        if not a.gate.clean:
            a.circuit.success()
        raise UpstreamError(f"upstream rejected the request ({exc.status_code}): {exc.message}") from None
    if not a.gate.clean or a.gate.verdict != "call":
        a.circuit.success()
    return Called(a, Used(a.pool, a.model, reply), _elapsed_ms(started), "")


def _upstream(job: Job, a: Admitted, target: Pool, model: str) -> UpstreamReply:
    """One call of ``target``: streamed (its chunks go to the waiting API process,
    gateway_tasks/upstream/streaming.py) or not."""
    req = a.req
    if req.endpoint == EMBEDDINGS:
        return embed(target, model, req.input, req.extra_body, task_id=job.task_id)
    if req.stream:
        return chat_streamed(job.r, job.keys, replace(req, model=model, max_tokens=a.max_tokens), target,
                             job.task_id, CHUNKS_TTL_S)
    return chat(target, model, req.messages, a.max_tokens, req.extra_body, task_id=job.task_id)


def _failed_over(job: Job, a: Admitted, reason: str, started: float) -> Called:
    """The call served by a backup pool, or a requeue while the task's retries last."""
    used, notes = fail_over(job.r, job.keys, job.settings, a.pool, a.backups,
                            lambda pool, model: _upstream(job, a, pool, model), job.reservation,
                            model=a.model, est_tokens=a.req.prompt_tokens + a.max_tokens, tier=a.req.tier,
                            reason=reason)
    if used is not None:
        return Called(a, used, _elapsed_ms(started), reason)
    failures = _count_failure(job)
    why = f"{reason}; no backup could take it ({', '.join(notes) or 'none configured'})"
    if not task_may_retry(failures, a.tier.max_retries):
        raise RetryBudgetExceeded(f"{why}; gave up after {failures} attempts", None, TASK_RETRIES_SPENT)
    logger.warning("pool %s: %s; requeued %s (retry %d of %d)", a.pool.name, why, job.task_id, failures,
                   a.tier.max_retries)
    raise Reject(f"{why}, requeued", requeue=True)


def _requeue_after_429(job: Job, a: Admitted, wait_ms: float) -> None:
    failures = _count_failure(job)
    max_retries = a.tier.max_retries
    if not task_may_retry(failures, max_retries):
        raise RetryBudgetExceeded(
            f"the upstream answered 429 to {failures} attempts of this task, its tier "
            f"{a.req.tier!r} allows {max_retries} retries; retry after {wait_ms / 1000:.1f} s",
            wait_ms / 1000.0, TASK_RETRIES_SPENT) from None
    _raise_if_cancelled(job)
    logger.warning("upstream 429 on pool %s: drained for %.0f ms, requeued %s (retry %d of %d)",
                   a.pool.name, wait_ms, job.task_id, failures, max_retries)
    raise Reject(f"upstream 429, requeued after {wait_ms:.0f} ms", requeue=True) from None


def _requeue_after_error(job: Job, a: Admitted, exc: Exception) -> None:
    _raise_if_cancelled(job)
    refusal = _retry_refusal(job, a)
    if not refusal:
        raise Reject(f"upstream error {type(exc).__name__}, requeued", requeue=True) from None
    what = (f"this task's {a.tier.max_retries} retries (tier {a.req.tier!r}) are spent"
            if refusal == TASK_RETRIES_SPENT else f"tier {a.req.tier!r}'s retry budget is spent")
    raise RetryBudgetExceeded(f"upstream failed and {what}: {exc}", None, refusal) from None


def _elapsed_ms(started: float) -> float:
    return (time.monotonic() - started) * 1000.0


def _count_failure(job: Job) -> int:
    """One more failed upstream attempt of a task (every requeue counts: 429s too); returns
    how many it has had."""
    key = job.keys.attempts(job.task_id)
    with job.r.pipeline(transaction=True) as pipe:      # one key: one slot
        pipe.incr(key)
        pipe.expire(key, job.settings.result_ttl_s)
        return int(pipe.execute()[0])


def task_may_retry(failures: int, max_retries: int) -> bool:
    """A task that failed ``failures`` times may run again while that is within its
    tier's ``max_retries`` (so at most max_retries + 1 upstream attempts)."""
    return failures <= max_retries


def _retry_refusal(job: Job, a: Admitted) -> str:
    """'' when a transient failure may be requeued (counted), else the reason it may not:
    the task's own retries are spent, or its tier's budget (retry_budget_ratio of completed
    requests) that stops retry storms."""
    tier, stats = a.tier, job.keys.stats(a.req.pool)
    if not task_may_retry(_count_failure(job), tier.max_retries):
        return TASK_RETRIES_SPENT
    retries_field = tier_field(RETRIES, tier.name)
    retries, completed = job.r.hmget(stats, retries_field, tier_field(COMPLETED, tier.name))
    budget = RETRY_BUDGET_FLOOR + tier.retry_budget_ratio * int(completed or 0)
    if int(retries or 0) >= budget:
        return TIER_RETRY_BUDGET_SPENT
    job.r.hincrby(stats, retries_field, 1)
    return ""


def _mark_of(raw: bytes | None) -> str | None:
    """A read of a task's cancel mark: what it was when cancelled ('queued', 'running',
    'gone'), or None when it was not cancelled."""
    return raw.decode() if raw is not None else None


def _raise_if_cancelled(job: Job) -> None:
    mark = _mark_of(job.r.get(job.keys.cancelled(job.task_id)))
    if mark is not None:
        raise _cancelled_error(job.task_id, mark)


def _cancelled_error(task_id: str, mark: str, after_call: bool = False) -> TaskCancelled:
    if after_call:
        return TaskCancelled(f"task {task_id} was cancelled while its upstream call ran; the call "
                             f"finished and its result was discarded", None, mark)
    return TaskCancelled(f"task {task_id} was cancelled ({mark}); the upstream was not called", None, mark)


# -- settle ---------------------------------------------------------------------------------
def settle(job: Job, outcome: Outcome) -> Settlement:
    """The one place the task's reservation is settled, whatever the outcome: the pool that
    served the call to its real usage, every unused debit and the tenant's unused TPM tokens
    given back (``Reservation.settle``)."""
    counted = _usage_call(job, outcome)
    if isinstance(outcome, Stopped):
        return job.reservation.settle(None, ends=outcome.ends, model=outcome.req.model if outcome.req else "",
                                      also=counted)
    # the upstream answered (and charged): a Redis restart now must not drop the answer.  In the
    # same round trip: whether the task was cancelled while the call ran, the task marked
    # done for the tasks that depend on it (deps_done.lua: failed if it was cancelled; the
    # task's end completes it), and its tenant's usage counted (lua/usage/count.lua)
    return through_restarts(lambda: job.reservation.settle(
        outcome.used, ends=True, also=[depends.done_call(job.keys, job.task_id), *counted],
        reads=[("GET", job.keys.cancelled(job.task_id))]), f"settle of task {job.task_id}")


def _usage_call(job: Job, outcome: Outcome) -> list[usage.UsageCall]:
    """The tenant's usage counters this run adds to (``gateway_tasks.usage.counters``): an
    answer served (its estimate, actual tokens, degradation), a failure or expiry that ends
    the task, the upstream 429s it absorbed; [] when there is nothing to count."""
    counts = dict(job.usage)
    if isinstance(outcome, Called):
        req, d, reply = outcome.admitted.req, job.dispatch, outcome.used.reply
        counts.update({usage.REQUESTS: 1, usage.EST_TOKENS: d.debited_tokens if d else req.est_tokens,
                       usage.ACTUAL_TOKENS: reply.total_tokens})
        if _degraded(outcome):
            counts[usage.DEGRADED] = 1
    else:
        req = outcome.req
        if outcome.ends and usage.EXPIRED not in counts and not isinstance(outcome.error, TaskCancelled):
            counts[usage.FAILED] = 1
    if req is None or not counts:
        return []
    return [usage.UsageCall(job.keys, req.tenant_id, int(time.time() * 1000), job.settings.usage_retention_days,
                            counts)]


# -- result ---------------------------------------------------------------------------------
def result(job: Job, outcome: Outcome, settlement: Settlement) -> dict[str, Any]:
    """The task's JSON result: the upstream's response, timing, tokens and what the load
    level changed -- or the outcome's error, raised."""
    if isinstance(outcome, Stopped):
        _report_refusal(job, outcome)
        raise outcome.error
    setattr(job.request, DEPS_DONE, settlement.also[0])
    kill_point(AFTER_SETTLE)
    mark = _mark_of(settlement.reads[0])
    if mark is not None:     # cancelled while the call ran: the tokens are spent, the result is not kept
        raise _cancelled_error(job.task_id, mark, after_call=True)
    a, used, d = outcome.admitted, outcome.used, job.dispatch
    req, reply = a.req, used.reply
    changes = _changes(job, outcome)
    UPSTREAM_TIME.add(job.r, job.keys, used.pool.name, req.tier, outcome.upstream_ms)   # capacity model latency
    enq_ms, disp_ms = (d.enqueued_ms, d.dispatched_ms) if d else (None, None)
    return {
        "task_id": job.task_id,
        "tenant_id": req.tenant_id,
        "tier": req.tier,
        "pool": used.pool.name,
        "model": used.model,
        "source": req.source,
        "lane": req.lane,
        "response": reply.body,
        "timing": {
            "enqueued_ms": enq_ms,
            "dispatched_ms": disp_ms,
            "completed_ms": settlement.settled.now_ms if settlement.settled else None,
            "queue_wait_ms": (disp_ms - enq_ms) if enq_ms and disp_ms else None,
            "upstream_ms": round(outcome.upstream_ms, 3),
            # the upstream's own part of it (its openai-processing-ms header; None if it sends none)
            "upstream_processing_ms": processing_ms(reply.headers),
        },
        "tokens": {
            "estimated": d.debited_tokens if d else req.est_tokens,
            "estimated_prompt": req.prompt_tokens,
            "prompt": reply.prompt_tokens,
            "completion": reply.completion_tokens,
            "total": reply.total_tokens,
        },
        "overload": changes,
    }


def _record(called: Called) -> dict[str, Any]:
    """What the producer and the load level changed (the result's "overload"), pure."""
    a, used = called.admitted, called.used
    req = a.req
    # what was asked for: the producer's record when it changed anything, else the request
    submitted = {"requested_max_tokens": req.max_tokens, "requested_model": req.model, **(req.degradation or {})}
    requested_pool = str(submitted.get("requested_pool", req.pool))
    failover_info = None
    if called.failover_reason:
        failover_info = {"from": a.pool.name, "to": used.pool.name, "reason": called.failover_reason,
                         "at": "dispatch"}
    elif submitted.get("failover"):
        failover_info = {"from": submitted.get("failover_from", requested_pool), "to": a.pool.name,
                         "reason": submitted["failover"], "at": submitted.get("failover_at", "submit")}
    return record(submitted, a.level, max_tokens=a.max_tokens, model=used.model, pool=used.pool.name,
                  requested_pool=requested_pool, failover=failover_info)


def _degraded(called: Called) -> bool:
    """Served with a capped max_tokens or a substituted model (the DEGRADED counters)."""
    changes = _record(called)
    return bool(changes["max_tokens"]["capped"] or changes["model"]["substituted"])


def _changes(job: Job, called: Called) -> dict[str, Any]:
    """What the producer and the load level changed (the result's "overload"), counted as a
    degradation when it capped max_tokens or substituted the model."""
    changes = _record(called)
    if changes["max_tokens"]["capped"] or changes["model"]["substituted"]:
        job.r.hincrby(job.keys.stats(called.used.pool.name), tier_field(DEGRADED, called.admitted.req.tier), 1)
    return changes


def _report_refusal(job: Job, stopped: Stopped) -> None:
    """An upstream's refusal (4xx): one log line without the upstream's words (they may quote
    the request), and for a streaming task the upstream's error object on its chunk stream at
    once (after the settle: the client learns of it with its tokens given back)."""
    exc = stopped.error
    if not isinstance(exc, UpstreamRejected):
        return
    req = stopped.req
    logger.warning("task %s of tenant %s: the upstream refused it with %d (type %s, code %s, "
                   "param %s); not retried", job.task_id, req.tenant_id if req else None, exc.status,
                   exc.type, exc.code, exc.param)
    if req is not None and req.stream:
        ChunkWriter(job.r, job.keys, job.task_id, CHUNKS_TTL_S).error(type(exc).__name__, str(exc),
                                                                     upstream=exc.openai_error())
