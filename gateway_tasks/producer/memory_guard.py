"""Refusing submits before Redis is full.

At ``maxmemory`` with ``noeviction`` Redis refuses every write -- the dispatch
scripts' and acks' too -- so a queue filled to the brim could not even drain.
Producers therefore refuse new work (``RedisFull``) once Redis uses
``Settings.redis_memory_refuse_ratio`` of its maxmemory, leaving the rest to
the workers; they read ``INFO memory`` at most every ``CHECK_EVERY_S`` (0.1 s).
"""

from __future__ import annotations

import time
from typing import Callable

import redis

from gateway_tasks.core.errors import RedisFull

CHECK_EVERY_S = 0.1


def over_limit(used_bytes: int, maxmemory_bytes: int, ratio: float) -> bool:
    """Whether Redis is past the share of its maxmemory where submits stop (no limit: never)."""
    return ratio > 0 and maxmemory_bytes > 0 and used_bytes >= ratio * maxmemory_bytes


class MemoryGuard:
    def __init__(self, client: redis.Redis, ratio: float, every_s: float = CHECK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.ratio, self.every_s, self.clock = client, ratio, every_s, clock
        self._checked_at = -float("inf")
        self._used = self._max = 0

    def check(self) -> None:
        """Raise RedisFull when Redis is past the limit (INFO read at most every every_s)."""
        if self.ratio <= 0:
            return
        now = self.clock()
        if now - self._checked_at >= self.every_s:
            info = self.client.info("memory")
            self._used, self._max = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
            self._checked_at = now
        if over_limit(self._used, self._max, self.ratio):
            raise RedisFull(f"submit refused: Redis uses {self._used / 2**20:.1f} MiB of its "
                            f"{self._max / 2**20:.1f} MiB maxmemory (limit {self.ratio:.0%}); nothing "
                            f"was enqueued -- retry once the queues drain")
