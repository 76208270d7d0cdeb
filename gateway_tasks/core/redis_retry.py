"""Riding out a Redis restart or a full Redis: a call that must not be dropped
(settling a finished upstream call, an ack, releasing a task's dependents) is
retried with back-off while Redis is unreachable or refuses it at its maxmemory
(noeviction: memory frees as queued work drains, or when an operator raises the
limit), for at most ``budget_s``; past it the error propagates.

The client a task uses (``riding_retry``) retries every command the same way on
connection errors, with the same pauses and budget, so the plain reads and
counters in a task's path (the pre-call pipeline, stats, the circuit) ride a
restart too: with redis-py's own default a command sent while Redis is down
fails at once (connection refused), and one in flight when it dies fails after a
few short jittered pauses."""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import redis
from redis.backoff import AbstractBackoff
from redis.retry import Retry

from gateway_tasks.core.redis_failures import CLUSTER_OUTAGES, is_out_of_memory

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_BUDGET_S = 60.0
FIRST_PAUSE_S, MAX_PAUSE_S = 0.1, 2.0


def backoff_s(attempt: int) -> float:
    """The pause before retry number ``attempt`` (0-based): 0.1, 0.2, 0.4 ... capped at 2 s."""
    return min(MAX_PAUSE_S, FIRST_PAUSE_S * (2 ** attempt))


def retries_within(budget_s: float) -> int:
    """How many retries fit in ``budget_s`` when each waits ``backoff_s`` before it (pure)."""
    spent, n = 0.0, 0
    while spent + backoff_s(n) <= budget_s:
        spent += backoff_s(n)
        n += 1
    return n


class RestartBackoff(AbstractBackoff):
    """redis-py's back-off with this module's pauses (redis-py counts failures from 1)."""

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return backoff_s(max(0, failures - 1))


def riding_retry(budget_s: float = RETRY_BUDGET_S) -> Retry:
    """The retry policy of a client whose every command rides a Redis restart: connection
    errors and timeouts retried with ``backoff_s`` pauses for about ``budget_s``."""
    return Retry(RestartBackoff(), retries_within(budget_s))


def worth_retrying(exc: BaseException) -> bool:
    """Whether a Redis error may go away by itself: unreachable (a restart), full, or on a
    Redis Cluster a master rejoining after its restart (CLUSTERDOWN) or a slot moving."""
    return (isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
                             redis.exceptions.TryAgainError, *CLUSTER_OUTAGES))
            or is_out_of_memory(exc))


def through_restarts(fn: Callable[[], T], what: str, budget_s: float = RETRY_BUDGET_S,
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> T:
    """``fn()``, retried on connection errors, timeouts and maxmemory refusals until
    ``budget_s`` is spent."""
    deadline = clock() + budget_s
    attempt = 0
    while True:
        try:
            return fn()
        except (redis.RedisError, *CLUSTER_OUTAGES) as exc:
            pause = backoff_s(attempt)
            if not worth_retrying(exc) or clock() + pause > deadline:
                raise
            why = "Redis is at its maxmemory" if is_out_of_memory(exc) else "Redis unreachable"
            logger.warning("%s: %s (%s); retrying in %.1f s", what, why, exc, pause)
            sleep(pause)
            attempt += 1
