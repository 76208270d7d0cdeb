"""The API's auth cache against a real Redis and the real app: a key it authenticated is
served from memory, and revocation stays effective at once -- a deleted tenant or a rotated
key is refused on the very next request, and while the cache's listener is cut off nothing
is served from memory."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from gateway_tasks.rest.app import create_app
from gateway_tasks.tenants.auth_cache import AuthCache

ROUTE = "/v1/status"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def status(client: TestClient, key: str) -> int:
    return client.get(ROUTE, headers=auth(key)).status_code


def unindex(gw, key: str) -> None:
    """Take the key out of Redis behind the registry's back (no change announced): only a
    request served from the cache can still authenticate with it."""
    gw.r.hdel(gw.keys.api_keys, *gw.r.hkeys(gw.keys.api_keys))


@pytest.fixture
def app_of(make_gateway, settings):
    def make(**changes):
        gw = make_gateway(settings=settings.with_(**changes))
        return gw, TestClient(create_app(gw))
    return make


def test_a_key_authenticated_once_is_served_from_memory(app_of):
    gw, client = app_of()
    key = gw.register_tenant("acme", "vip")
    with client:
        assert status(client, key) == 200
        unindex(gw, key)
        assert status(client, key) == 200          # from the cache: Redis no longer knows the key
        assert status(client, "gt-not-a-key") == 401


def test_a_deleted_tenant_is_refused_on_the_next_request(app_of):
    gw, client = app_of(auth_cache_s=60.0)
    key = gw.register_tenant("acme", "vip")
    with client:
        assert status(client, key) == 200
        gw.delete_tenant("acme")
        deadline = time.monotonic() + 2.0           # the notice crosses one pub/sub hop
        while status(client, key) != 401 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert status(client, key) == 401


def test_a_rotated_key_is_refused_and_the_new_one_accepted(app_of):
    gw, client = app_of(auth_cache_s=60.0)
    old = gw.register_tenant("acme", "vip")
    with client:
        assert status(client, old) == 200
        new = gw.register_tenant("acme", "vip")     # a new key for the same tenant
        deadline = time.monotonic() + 2.0
        while status(client, old) != 401 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert status(client, old) == 401
        assert status(client, new) == 200


def test_nothing_is_served_from_memory_while_the_listener_is_cut_off(app_of, r):
    gw, client = app_of(auth_cache_s=60.0)
    key = gw.register_tenant("acme", "vip")
    with client:
        assert status(client, key) == 200
        name = f"{gw.settings.key_prefix}auth-cache"
        ids = [c["id"] for c in r.client_list() if c.get("name") == name]
        assert len(ids) == 1
        r.client_kill_filter(_id=ids[0])            # its notices could be lost from now on
        time.sleep(0.3)
        unindex(gw, key)
        assert status(client, key) == 401           # read through Redis, which no longer knows it


def test_entries_end_after_auth_cache_s(app_of):
    gw, client = app_of(auth_cache_s=0.2)
    key = gw.register_tenant("acme", "vip")
    with client:
        assert status(client, key) == 200
        unindex(gw, key)
        time.sleep(0.3)
        assert status(client, key) == 401


def test_auth_cache_s_0_reads_redis_every_time(app_of):
    gw, client = app_of(auth_cache_s=0.0)
    key = gw.register_tenant("acme", "vip")
    with client:
        assert status(client, key) == 200
        unindex(gw, key)
        assert status(client, key) == 401


def test_the_cache_keeps_at_most_auth_cache_entries_keys_the_oldest_going_first(app_of):
    gw, client = app_of(auth_cache_s=60.0, auth_cache_entries=2)
    keys = [gw.register_tenant(f"t{i}", "vip") for i in range(3)]
    with client:
        assert [status(client, k) for k in keys] == [200, 200, 200]
        unindex(gw, keys[0])
        assert [status(client, k) for k in keys] == [401, 200, 200]


def test_the_cache_shows_no_key(settings):
    from gateway_tasks.core.keys import Keys
    assert repr(AuthCache(settings.redis_url, Keys(settings.key_prefix), 5.0, 3)) == \
        "AuthCache(ttl_s=5.0, entries=0, live=False)"
