"""Riding out a Redis restart: a call that must not be dropped (settling a finished
upstream call, an ack) is retried with back-off while Redis is unreachable, for
at most ``budget_s``; past it the error propagates."""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import redis

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_BUDGET_S = 60.0
FIRST_PAUSE_S, MAX_PAUSE_S = 0.1, 2.0


def backoff_s(attempt: int) -> float:
    """The pause before retry number ``attempt`` (0-based): 0.1, 0.2, 0.4 ... capped at 2 s."""
    return min(MAX_PAUSE_S, FIRST_PAUSE_S * (2 ** attempt))


def through_restarts(fn: Callable[[], T], what: str, budget_s: float = RETRY_BUDGET_S,
                     sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> T:
    """``fn()``, retried on connection errors and timeouts until ``budget_s`` is spent."""
    deadline = clock() + budget_s
    attempt = 0
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            pause = backoff_s(attempt)
            if clock() + pause > deadline:
                raise
            logger.warning("%s: Redis unreachable (%s); retrying in %.1f s", what, exc, pause)
            sleep(pause)
            attempt += 1
