"""The Redis a dev run (the demo, a benchmark, the test suite) works on, and its cleanup.

``redis_or_embedded`` gives REDIS_URL when it is set, else starts a private embedded
redis-server (``gateway_tasks.local.redis_server``) for the block; ``shown_redis`` says
where it is without credentials.  ``delete_prefix`` removes a run's keys afterwards
(``discard_prefix`` when an error must not hide how the run ended)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import redis

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.urls import without_credentials
from gateway_tasks.local.redis_server import EmbeddedRedis


@contextlib.contextmanager
def redis_or_embedded(url: str) -> Iterator[tuple[str, bool]]:
    """``(url, embedded)`` for the block: ``url`` when it is set, else the URL of a
    private EmbeddedRedis started for the block."""
    if url:
        yield url, False
        return
    with EmbeddedRedis() as server:
        yield server.url, True


def shown_redis(url: str, embedded: bool) -> str:
    """Where the Redis of ``redis_or_embedded`` is, for output: never a password."""
    if embedded:
        return f"embedded redis-server at {url} (REDIS_URL unset)"
    return without_credentials(url)


def redis_reachable(url: str, timeout_s: float = 0.5) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout_s).ping())
    except (redis.RedisError, OSError):
        return False


def delete_prefix(client: redis.Redis, prefix: str, batch: int = 1000) -> int:
    """Delete every key starting with prefix (SCAN, never KEYS; UNLINK ``batch`` keys at a
    time); returns how many."""
    if not prefix:
        raise ConfigError("refusing to delete keys with an empty prefix")
    deleted = 0
    keys: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=batch):
        keys.append(key)
        if len(keys) >= batch:
            deleted += client.unlink(*keys)
            keys.clear()
    if keys:
        deleted += client.unlink(*keys)
    return deleted


def discard_prefix(client: redis.Redis, prefix: str) -> None:
    """delete_prefix when cleaning up after a run: a Redis error then is ignored, so it
    cannot hide how the run itself ended."""
    with contextlib.suppress(redis.RedisError):
        delete_prefix(client, prefix)
