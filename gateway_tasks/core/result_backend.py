"""The result backend: Celery's Redis backend, whose retries also ride out a full Redis.

``result_backend_always_retry`` retries a result write (STARTED, SUCCESS, FAILURE)
with exponential back-off -- but Celery's Redis backend counts only connection
errors as worth it, so a result refused at ``maxmemory`` (noeviction) was dropped
and its task, acked, never reached a final state.  Here that refusal is retried
as well (``result_backend_max_retries`` times, ~1 minute in all): memory frees as
the queues drain, or when the limit is raised.
"""

from __future__ import annotations

from celery.backends.redis import RedisBackend

from gateway_tasks.core.oom import is_out_of_memory

RESULT_BACKEND = "gateway_tasks.core.result_backend:ResultBackend"


def backend_url(redis_url: str) -> str:
    """The ``result_backend`` setting for a Redis URL: this backend, at that URL."""
    return f"{RESULT_BACKEND}+{redis_url}"


class ResultBackend(RedisBackend):
    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return bool(super().exception_safe_to_retry(exc)) or is_out_of_memory(exc)
