"""Reading Celery result keys in bulk, for the benchmarks: how many exist, and
the stored result metas (JSON), in chunks so no command grows unbounded."""

from __future__ import annotations

import json
from typing import Any, Sequence

import redis

EXISTS_CHUNK = 1000
MGET_CHUNK = 500


def count_existing(client: redis.Redis, keys: Sequence[bytes | str]) -> int:
    """How many of ``keys`` exist now."""
    return sum(int(client.exists(*keys[i:i + EXISTS_CHUNK]))
               for i in range(0, len(keys), EXISTS_CHUNK))


def result_metas(client: redis.Redis, keys: Sequence[bytes | str]) -> list[dict[str, Any]]:
    """The stored result metas of these keys; missing ones are skipped."""
    out = []
    for i in range(0, len(keys), MGET_CHUNK):
        for raw in client.mget(keys[i:i + MGET_CHUNK]):
            if raw is not None:
                out.append(json.loads(raw))
    return out
