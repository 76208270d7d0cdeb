"""The inference task: runs after pick.lua admitted it through the pool bucket.

It calls the upstream once, settles the bucket to the real usage, follows the
upstream's rate-limit headers, and on failure either requeues the message at
the front of its queue (429: the pool is drained until Retry-After; other
transient errors: while the tier's retry budget lasts) or fails with a clear
error.  A 4xx that is the caller's error (UpstreamRejected) fails at once: no
retry, no failover, nothing told to the circuit; its tokens are given back.
The result is JSON: the upstream response plus timing and tokens.  Its stages
are ``workers.pipeline``'s.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery import shared_task
from celery.exceptions import Ignore, Reject

from gateway_tasks.lifecycle import depends
from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.core.errors import UpstreamRejected
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.result_backend import STARTED_WITH_FIRST_TRIP
from workers import pipeline
from workers.pipeline import DEPS_DONE, redis_for
from gateway_tasks.core.redis_retry import through_restarts

logger = logging.getLogger(__name__)
RESULT_HIDING_REQUEST = "workers.redaction:ResultHidingRequest"  # results stay out of task events


# throws: Celery logs these failures as expected (no traceback); the task logs its own line
@shared_task(bind=True, name="gateway.infer", acks_late=True, reject_on_worker_lost=True,
             Request=RESULT_HIDING_REQUEST, throws=(UpstreamRejected,), **{STARTED_WITH_FIRST_TRIP: True})
def infer(self: Any, body: dict[str, Any]) -> dict[str, Any]:
    """One inference; when it ends (not requeued), the tasks held on it are released."""
    try:
        result = pipeline.run(self, body)
    except (Reject, Ignore):   # requeued, or another dispatch of it runs: not finished here
        raise
    except Exception:
        _finished(self, ok=False)
        raise
    _finished(self, ok=True)
    return result


def _finished(task: Any, ok: bool) -> None:
    settings = settings_of(task.app)
    done = getattr(task.request, DEPS_DONE, None)   # marked done already, in the settle round trip
    try:
        through_restarts(lambda: depends.finish(task.app, redis_for(settings.redis_url),
                                                Keys(settings.key_prefix), settings.result_ttl_s,
                                                task.request.id, ok, done),
                         f"release of the tasks depending on {task.request.id}")
    except redis.RedisError:   # the result still stands; its dependents wait for their TTL
        logger.warning("could not release the tasks depending on %s", task.request.id, exc_info=True)


@shared_task(name="gateway.noop", acks_late=True, reject_on_worker_lost=True,
             Request=RESULT_HIDING_REQUEST)
def noop(tag: Any = None) -> dict[str, Any]:
    """No upstream call: measures the queue itself (`gateway-dev bench` compares the
    gateway transport with plain Celery on this task).  ``started`` is the
    worker's wall clock when the task began."""
    return {"tag": tag, "started": time.time()}
