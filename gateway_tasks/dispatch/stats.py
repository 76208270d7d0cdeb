"""What a dispatcher counts of its own dispatches, flushed to Redis in batches.

pick.lua does not count: a counter per dispatch in the script would be three
more writes on every pick.  The dispatcher knows every figure from the reply
-- the tier, the estimated tokens debited, the queue wait -- and adds them to
its pool's stats hash (``Keys.stats``) with the round-trip counters of
``Keys.dispatch_stats``, in one pipeline every ``FLUSH_EVERY`` round trips or
``FLUSH_AFTER_S`` seconds, whichever comes first, and when it closes.  A
dispatcher killed with -9 loses at most that much of its statistics, never a
task: the counters are for metrics and benches, not for any decision.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Callable

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.stats import DISPATCH_COUNTERS, DISPATCH_DISPATCHED, DISPATCHED, EST_TOKENS, WAIT_MS, tier_field
from gateway_tasks.dispatch.router import Picked

logger = logging.getLogger(__name__)

FLUSH_EVERY = 50      # round trips between two flushes at most
FLUSH_AFTER_S = 0.5   # seconds between two flushes at most (while the dispatcher polls)


class DispatchTally:
    """One dispatcher's unflushed counters."""

    def __init__(self, keys: Keys, clock: Callable[[], float] = time.monotonic):
        self.keys = keys
        self.clock = clock
        self._round_trips = dict.fromkeys(DISPATCH_COUNTERS, 0)
        self._pools: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._since = clock()

    def round_trip(self, name: str) -> None:
        self._round_trips[name] += 1

    def dispatched(self, picked: Picked) -> None:
        self._round_trips[DISPATCH_DISPATCHED] += 1
        fields = self._pools[picked.pool]
        fields[tier_field(DISPATCHED, picked.tier)] += 1
        fields[tier_field(EST_TOKENS, picked.tier)] += picked.est_tokens
        fields[tier_field(WAIT_MS, picked.tier)] += max(0, picked.dispatched_ms - picked.enqueued_ms)

    def due(self) -> bool:
        trips = sum(self._round_trips.values()) - self._round_trips[DISPATCH_DISPATCHED]
        return trips >= FLUSH_EVERY or (self.clock() - self._since >= FLUSH_AFTER_S and self.pending())

    def pending(self) -> bool:
        return any(self._round_trips.values()) or bool(self._pools)

    def flush(self, client: redis.Redis) -> None:
        """Add the counters to Redis and start again; a failure only loses statistics."""
        trips, pools = self._round_trips, self._pools
        self._round_trips = dict.fromkeys(DISPATCH_COUNTERS, 0)
        self._pools = defaultdict(lambda: defaultdict(int))
        self._since = self.clock()
        if not any(trips.values()) and not pools:
            return
        try:
            with client.pipeline(transaction=False) as pipe:
                for name, n in trips.items():
                    if n:
                        pipe.hincrby(self.keys.dispatch_stats, name, n)
                for pool, fields in pools.items():
                    for field, n in fields.items():
                        pipe.hincrby(self.keys.stats(pool), field, n)
                pipe.execute()
        except redis.RedisError:  # statistics only: never break dispatch for them
            logger.debug("could not flush dispatch counters", exc_info=True)
