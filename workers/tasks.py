"""The inference task: runs after pick.lua admitted it through the pool bucket.

It calls the upstream once, settles the bucket to the real usage, follows the
upstream's rate-limit headers, and on failure either requeues the message at
the front of its queue (429: the pool is drained until Retry-After; other
transient errors: while the tier's retry budget lasts) or fails with a clear
error.  The result is JSON: the upstream response plus timing and tokens.
"""

from __future__ import annotations

import logging
import time
from functools import lru_cache
from typing import Any

import openai
import redis
from celery import shared_task
from celery.exceptions import Reject

from workers.bucket import PoolBucket, retry_after_ms
from gateway_tasks.core.errors import ConfigError, DeadlineExceeded, InvalidRequest, UpstreamError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.request import (HEADER_DISPATCHED_MS, HEADER_ENQUEUED_MS, HEADER_EST_TOKENS, HEADER_TENANT,
                                         HEADER_POOL_DEBITED, HEADER_POOL_DISPATCHES, InferenceRequest)
from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.core.settings import Settings
from gateway_tasks.core.stats import COMPLETED, EXPIRED, RETRIES, tier_field
from workers.dead_letter import dispatched_queue, refund_unrunnable
from workers.faults import AFTER_SETTLE, AFTER_UPSTREAM, kill_point
from workers.redis_retry import through_restarts
from workers.upstream import chat
from workers.streaming import chat_streamed
from workers.upstream_stats import TALLY as UPSTREAM_TIME

logger = logging.getLogger(__name__)
RESULT_HIDING_REQUEST = "workers.redaction:ResultHidingRequest"  # results stay out of task events
MAX_ATTEMPTS = 5
RETRY_BUDGET_FLOOR = 10  # retries always allowed per tier before the ratio applies
CHUNKS_TTL_S = 600       # a streaming task's chunks stay readable this long


@lru_cache(maxsize=8)
def redis_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _settings(task: Any) -> Settings:
    return settings_of(task.app)


def _count_attempt(r: redis.Redis, keys: Keys, settings: Settings, task_id: str) -> int:
    """One more upstream attempt of a task (every requeue counts: 429s too); returns the count."""
    with r.pipeline() as pipe:
        pipe.incr(keys.attempts(task_id))
        pipe.expire(keys.attempts(task_id), settings.result_ttl_s)
        return int(pipe.execute()[0])


def _retry_allowed(r: redis.Redis, keys: Keys, settings: Settings, req: InferenceRequest,
                   task_id: str) -> bool:
    tier = settings.tier(req.tier)
    stats = keys.stats(req.pool)
    if _count_attempt(r, keys, settings, task_id) >= MAX_ATTEMPTS:
        return False
    retries_field = tier_field(RETRIES, tier.name)
    retries, completed = r.hmget(stats, retries_field, tier_field(COMPLETED, tier.name))
    budget = RETRY_BUDGET_FLOOR + tier.retry_budget_ratio * int(completed or 0)
    if int(retries or 0) >= budget:
        return False
    r.hincrby(stats, retries_field, 1)
    return True


def effective_deadline_s(deadline_s: float | None, queue_ttl_s: float) -> tuple[float | None, str]:
    """The tighter of the request's deadline and the tier's queue TTL (0 = none)."""
    if queue_ttl_s and (not deadline_s or queue_ttl_s < deadline_s):
        return queue_ttl_s, "tier queue TTL"
    return (deadline_s or None), "deadline"


@shared_task(bind=True, name="gateway.infer", acks_late=True, reject_on_worker_lost=True,
             Request=RESULT_HIDING_REQUEST)
def infer(self: Any, body: dict[str, Any]) -> dict[str, Any]:
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

    limit_s, why = effective_deadline_s(req.deadline_s, settings.tier(req.tier).queue_ttl_s)
    if limit_s and enq_ms and disp_ms and disp_ms > enq_ms + limit_s * 1000:
        refund()
        r.hincrby(keys.stats(pool.name), tier_field(EXPIRED, req.tier), 1)
        raise DeadlineExceeded(f"task waited {disp_ms - enq_ms} ms, past its {why} of "
                               f"{limit_s} s; the upstream was not called")

    started = time.monotonic()
    try:
        if req.stream:   # issue 12: chunks go to the waiting API process (workers/streaming.py)
            reply = chat_streamed(r, keys, req, pool, self.request.id, CHUNKS_TTL_S)
        else:
            reply = chat(pool, req.model, req.messages, req.max_tokens, req.extra_body, task_id=self.request.id)
    except openai.RateLimitError as exc:
        wait = retry_after_ms(dict(exc.response.headers))
        bucket.drain(wait)
        attempts = _count_attempt(r, keys, settings, self.request.id)
        if attempts >= MAX_ATTEMPTS:
            raise UpstreamError(f"the upstream answered 429 to {attempts} attempts of this task; "
                                f"giving up (retry after {wait / 1000:.1f} s)") from None
        logger.warning("upstream 429 on pool %s: drained for %.0f ms, requeued %s (attempt %d of %d)",
                       pool.name, wait, self.request.id, attempts, MAX_ATTEMPTS)
        raise Reject(f"upstream 429, requeued after {wait:.0f} ms", requeue=True) from None
    except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError) as exc:
        refund()
        if _retry_allowed(r, keys, settings, req, self.request.id):
            raise Reject(f"upstream error {type(exc).__name__}, requeued", requeue=True) from None
        raise UpstreamError(f"upstream failed and the retry budget is spent: {exc}") from None
    except openai.APIStatusError as exc:
        refund()
        raise UpstreamError(f"upstream rejected the request ({exc.status_code}): {exc.message}") from None
    upstream_ms = (time.monotonic() - started) * 1000.0
    kill_point(AFTER_UPSTREAM)

    # one call: the real usage, the reply's rate-limit headers, and the Redis clock; the
    # upstream answered (and charged): a Redis restart now must not drop the answer
    settled = through_restarts(lambda: bucket.settle_reply(
        est_tokens=est, actual_tokens=reply.total_tokens, tier=req.tier, tenant_id=req.tenant_id,
        model=req.model, completion_tokens=reply.completion_tokens, headers=reply.headers,
        debited_tokens_at_dispatch=get(HEADER_POOL_DEBITED),
        dispatches_at_dispatch=get(HEADER_POOL_DISPATCHES)), f"settle of task {self.request.id}")
    kill_point(AFTER_SETTLE)
    done_ms = settled.now_ms
    UPSTREAM_TIME.add(r, keys, pool.name, req.tier, upstream_ms)   # issue 12: capacity model latency
    return {
        "task_id": self.request.id,
        "tenant_id": req.tenant_id,
        "tier": req.tier,
        "pool": pool.name,
        "model": req.model,
        "source": req.source,
        "response": reply.body,
        "timing": {
            "enqueued_ms": enq_ms,
            "dispatched_ms": disp_ms,
            "completed_ms": done_ms,
            "queue_wait_ms": (disp_ms - enq_ms) if enq_ms and disp_ms else None,
            "upstream_ms": round(upstream_ms, 3),
        },
        "tokens": {
            "estimated": est,
            "estimated_prompt": req.prompt_tokens,
            "prompt": reply.prompt_tokens,
            "completion": reply.completion_tokens,
            "total": reply.total_tokens,
        },
    }


@shared_task(name="gateway.noop", acks_late=True, reject_on_worker_lost=True,
             Request=RESULT_HIDING_REQUEST)
def noop(tag: Any = None) -> dict[str, Any]:
    """No upstream call: measures the queue itself (`gateway bench` compares the
    gateway transport with plain Celery on this task).  ``started`` is the
    worker's wall clock when the task began."""
    return {"tag": tag, "started": time.time()}
