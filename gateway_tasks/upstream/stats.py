"""Upstream call time of completed calls, summed per pool and tier (``upstream_ms:<tier>``
in ``Keys.stats(pool)``: the capacity model's latency, ``gateway capacity --measure-s``).

Counted in the worker process and added to Redis in batches -- one pipeline every
``FLUSH_EVERY`` calls or ``FLUSH_AFTER_S`` seconds, whichever comes first -- so
no call pays a round trip of its own.  A worker killed with -9 loses at most
that much of it: the counter is for capacity planning, not for any decision.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.stats import UPSTREAM_MS, tier_field

logger = logging.getLogger(__name__)

FLUSH_EVERY = 50
FLUSH_AFTER_S = 1.0


class UpstreamTimeTally:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms: dict[tuple[str, str, str], float] = defaultdict(float)   # (prefix, pool, tier) ->
        self._calls = 0
        self._since = time.monotonic()

    def add(self, client: redis.Redis, keys: Keys, pool: str, tier: str, upstream_ms: float) -> None:
        with self._lock:
            self._ms[(keys.prefix, pool, tier)] += upstream_ms
            self._calls += 1
            if self._calls < FLUSH_EVERY and time.monotonic() - self._since < FLUSH_AFTER_S:
                return
            pending, self._ms = self._ms, defaultdict(float)
            self._calls, self._since = 0, time.monotonic()
        try:
            with client.pipeline(transaction=False) as pipe:
                for (prefix, p, t), ms in pending.items():
                    pipe.hincrby(Keys(prefix).stats(p), tier_field(UPSTREAM_MS, t), int(round(ms)))
                pipe.execute()
        except redis.RedisError:       # statistics only: never fail a task for them
            logger.debug("could not flush upstream call time", exc_info=True)


TALLY = UpstreamTimeTally()
