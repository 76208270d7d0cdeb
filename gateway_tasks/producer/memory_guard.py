"""Refusing submits before Redis is full.

At ``maxmemory`` with ``noeviction`` Redis refuses every write that may grow memory
-- the dispatch scripts', the results' -- so a queue filled to the brim could not
even drain (workers ride such refusals out, ``gateway_tasks.core.redis_retry``, but only
memory freed elsewhere lets them go on).  Producers therefore refuse new work
(``RedisFull``) from ``refuse_at_bytes`` on: the lower of
``Settings.redis_memory_refuse_ratio`` of maxmemory and maxmemory less
``Settings.redis_memory_reserve_mib``.  That head-room is for the workers: the
buffers of every connection they open (a worker of concurrency 8 starting on a
full queue took ~1 MiB at once, measured on Redis 6.2 and 7.0), the results and
dispatch records of the tasks in flight.

The guard reads ``INFO memory`` every ``CHECK_EVERY_S`` (0.1 s) and adds the
bytes of its own submits since (``charge``, an estimate).  It reads again before
a submit, sooner than that, once the limit is within reach: of its own submits
since the last read, or of Redis's growth over one interval at the rate measured
between its reads -- every producer's submits together, which it cannot count.
So a burst from one producer stops within a submit of the limit, and producers
sharing a Redis overshoot it by the submits in flight at that moment, not by an
interval of everybody's traffic.  A refusal rests on a read; a read that was
over the limit stands for the interval (a flood of refused submits costs no
INFO calls).  On a Redis Cluster it reads every master's and goes by the one with
the least head-room (a full master refuses its slots' writes, whichever pool or
tenant they are of).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import redis
from redis.cluster import RedisCluster

from gateway_tasks.core.errors import RedisFull

CHECK_EVERY_S = 0.1
MIB = 2**20
# what a submit adds to Redis besides its payload: kombu's envelope and headers, the
# index entry, the task's owner and reference keys (measured: ~1.6 KB, 8 KB prompt ~12.8 KB)
SUBMIT_OVERHEAD_BYTES = 2048


def refuse_at_bytes(maxmemory_bytes: int, ratio: float, reserve_bytes: int = 0) -> float | None:
    """Used memory from which submits are refused: the lower of ``ratio`` of maxmemory and
    maxmemory less ``reserve_bytes``; None: never (no maxmemory, or ratio 0: the guard is off)."""
    if ratio <= 0 or maxmemory_bytes <= 0:
        return None
    return min(ratio * maxmemory_bytes, float(maxmemory_bytes - reserve_bytes))


def over_limit(used_bytes: int, maxmemory_bytes: int, ratio: float, reserve_bytes: int = 0) -> bool:
    """Whether Redis is past the point where submits stop (no limit: never)."""
    limit = refuse_at_bytes(maxmemory_bytes, ratio, reserve_bytes)
    return limit is not None and used_bytes >= limit


def near_limit(used_bytes: float, growth_bytes_per_s: float, horizon_s: float, limit: float | None) -> bool:
    """Whether Redis, growing at that rate, could reach the limit within ``horizon_s``."""
    return limit is not None and used_bytes + max(0.0, growth_bytes_per_s) * horizon_s >= limit


def submit_bytes(payload_json_bytes: int) -> int:
    """What one submit adds to Redis, about: its JSON payload base64-encoded in the message
    (kombu's body encoding, 4/3) plus ``SUBMIT_OVERHEAD_BYTES``."""
    return (4 * payload_json_bytes + 2) // 3 + SUBMIT_OVERHEAD_BYTES


class MemoryGuard:
    """One producer's view of Redis memory: ``check()`` before a submit, ``charge(n)`` after
    one (thread-safe: the REST API submits from a thread pool)."""

    def __init__(self, client: redis.Redis, ratio: float, reserve_bytes: int = 0,
                 every_s: float = CHECK_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.client, self.ratio, self.reserve_bytes = client, ratio, reserve_bytes
        self.every_s, self.clock = every_s, clock
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._used = self._max = 0
        self._charged = 0            # bytes of this producer's submits since the last read
        self._rate = 0.0             # Redis's growth, bytes/s, over the last >= every_s between reads
        self._anchor: tuple[float, int] | None = None   # (when, used) the rate is measured from

    def check(self) -> None:
        """Raise RedisFull when Redis is past the limit (INFO read every every_s, and before
        the submit when the limit is within reach)."""
        if self.ratio <= 0:
            return
        with self._lock:
            now = self.clock()
            limit = refuse_at_bytes(self._max, self.ratio, self.reserve_bytes)
            read_over = limit is not None and self._used >= limit
            if (now - self._read_at >= self.every_s
                    or (not read_over and near_limit(self._used + self._charged, self._rate,
                                                     self.every_s, limit))):
                self._read(now)
                limit = refuse_at_bytes(self._max, self.ratio, self.reserve_bytes)
            used, maximum = self._used + self._charged, self._max
        if limit is not None and used >= limit:
            raise RedisFull(f"submit refused: Redis uses {used / MIB:.1f} MiB of its {maximum / MIB:.1f} MiB "
                            f"maxmemory; submits stop at {limit / MIB:.1f} MiB ({self.ratio:.0%}, and at "
                            f"least {self.reserve_bytes / MIB:g} MiB left to the workers); nothing was "
                            f"enqueued -- retry once the queues drain")

    def charge(self, nbytes: int) -> None:
        """Count a submit's bytes until the next INFO read (which sees them)."""
        with self._lock:
            self._charged += max(0, nbytes)

    def _read(self, now: float) -> None:
        used, maximum = self._fullest()
        if self._anchor is None:
            self._anchor = (now, used)
        elif now - self._anchor[0] >= self.every_s:   # a rate over at least one interval, not noise
            self._rate = max(0.0, (used - self._anchor[1]) / (now - self._anchor[0]))
            self._anchor = (now, used)
        self._used, self._max, self._read_at, self._charged = used, maximum, now, 0

    def _fullest(self) -> tuple[int, int]:
        """(used_memory, maxmemory) of the server, or of the master closest to its limit."""
        if not isinstance(self.client, RedisCluster):
            info = self.client.info("memory")
            return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        masters = self.client.info("memory", target_nodes=RedisCluster.PRIMARIES).values()
        pairs = [(int(i.get("used_memory", 0)), int(i.get("maxmemory", 0))) for i in masters]
        return min(pairs, key=lambda p: (p[1] - p[0]) if p[1] > 0 else float("inf"))
