"""The deployment's clock: Redis TIME, never a worker's (the router compares it)."""

from __future__ import annotations

import redis


def redis_now_ms(client: redis.Redis) -> int:
    """Redis TIME in whole milliseconds since the epoch."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000
