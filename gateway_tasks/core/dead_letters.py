"""The dead-letter records of a pool (``Keys.dead_letters``): written by
``workers.dead_letter`` for messages no worker can run, read by operators
(``gateway dead-letters``) and tests.

A record is JSON: ``tag``, ``queue``, ``tenant``, ``tier``, ``task_id`` ('' when
the message names none), ``reason``, ``at_ms``, ``message`` (its first
``RAW_KEPT_CHARS`` characters) and ``message_chars``.  The list keeps the
newest ``DEAD_LETTERS_KEPT``, newest first.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from gateway_tasks.core.keys import Keys

DEAD_LETTERS_KEPT = 1000
RAW_KEPT_CHARS = 65_536


def dead_letters(client: redis.Redis, keys: Keys, pool: str, count: int = 100) -> list[dict[str, Any]]:
    """The newest ``count`` dead-letter records of a pool."""
    return [json.loads(x) for x in client.lrange(keys.dead_letters(pool), 0, max(0, count - 1))]
