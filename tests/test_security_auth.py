"""Security of the REST API against a real Redis: API keys hashed at rest (keyed,
migrated from older schemes), every route behind a credential (deny by default),
tenants isolated from each other (404, never 403), admin routes behind their own
credential."""

from __future__ import annotations

import hashlib
import json

import pytest
from fastapi.testclient import TestClient

from gateway_tasks.tenants import registry as tenants_module
from gateway_tasks.core.errors import ConfigError, UnknownTenant
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, settings_to_json
from gateway_tasks.tenants.registry import TenantRegistry, hash_api_key
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app
from gateway_tasks.rest.auth import ADMIN, PUBLIC, TENANT, access_of

HELLO = [{"role": "user", "content": "hello there"}]
ADMIN_KEY = "adm-" + "A1b2C3d4" * 4
SECRET = "pepper-" + "s3cr3t" * 4
UPSTREAM_KEY = "sk-planted-upstream-key-7f3a"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def gateway(make_gateway, settings):
    pool = Pool("default", base_url="http://127.0.0.1:9/v1", api_key=UPSTREAM_KEY,
                models=("gpt-4o-mini",), tpm=600_000, rpm=6_000)
    return make_gateway(settings=settings.with_(admin_key=ADMIN_KEY, api_key_secret=SECRET, pools=(pool,)),
                        client=None)


def all_stored_bytes(r, prefix: str) -> bytes:
    """Every key name and value under a prefix, concatenated (hashes, sets, strings)."""
    out = []
    for key in r.scan_iter(match=f"{prefix}*"):
        out.append(key)
        kind = r.type(key).decode()
        if kind == "hash":
            out += [b for kv in r.hgetall(key).items() for b in kv]
        elif kind == "set":
            out += list(r.smembers(key))
        elif kind == "string":
            out.append(r.get(key))
    return b"\n".join(out)


# -- hashed at rest ---------------------------------------------------------------
def test_api_keys_are_stored_only_as_keyed_hashes(gateway, r, key_prefix):
    chosen = "my-chosen-key-123"
    gateway.register_tenant("acme", "vip", api_key=chosen)
    generated = gateway.register_tenant("bob", "batch")
    stored = all_stored_bytes(r, key_prefix)
    for key in (chosen, generated):
        assert key.encode() not in stored
        # nor its plain SHA-256: the hash is keyed with api_key_secret
        assert hashlib.sha256(key.encode()).hexdigest().encode() not in stored
    record = r.hgetall(Keys(key_prefix).tenant("acme"))
    assert record[b"api_key_hash"].decode() == hash_api_key(chosen, SECRET)
    assert record[b"api_key_hash"].startswith(b"hmac-sha256:")
    assert gateway.tenants.authenticate(chosen).tenant_id == "acme"
    # another secret: the same key no longer matches (the hash depends on the secret)
    other = TenantRegistry(r, gateway.settings.with_(api_key_secret="another-secret-0123456789"))
    with pytest.raises(UnknownTenant):
        other.authenticate(chosen)


def test_key_comparison_is_constant_time(gateway, monkeypatch):
    key = gateway.register_tenant("acme", "vip")
    seen = []
    real = tenants_module.hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenants_module.hmac, "compare_digest", spy)
    assert gateway.tenants.authenticate(key).tenant_id == "acme"
    assert seen and seen[-1][0] == seen[-1][1] == hash_api_key(key, SECRET)


def test_legacy_bare_sha256_registrations_are_migrated_transparently(gateway, r, key_prefix):
    """A tenant written by an older release (bare SHA-256 hex in api_key_sha256 and
    in the key index) authenticates once with its old key and is rehashed."""
    keys = Keys(key_prefix)
    old_key = "gt-registered-by-an-old-release"
    legacy = hashlib.sha256(old_key.encode()).hexdigest()
    r.hset(keys.tenant("legacy"), mapping={"tier": "normal", "api_key_sha256": legacy,
                                           "created_ms": 1, "weight": 1.0})
    r.hset(keys.api_keys, legacy, "legacy")
    r.sadd(keys.tenants, "legacy")
    tenant = gateway.tenants.authenticate(old_key)
    assert tenant.tenant_id == "legacy" and tenant.api_key_hash == hash_api_key(old_key, SECRET)
    record = r.hgetall(keys.tenant("legacy"))
    assert b"api_key_sha256" not in record
    assert record[b"api_key_hash"].decode() == hash_api_key(old_key, SECRET)
    assert r.hkeys(keys.api_keys) == [hash_api_key(old_key, SECRET).encode()]
    assert gateway.tenants.authenticate(old_key).tenant_id == "legacy"   # and again, rehashed
    with pytest.raises(UnknownTenant):
        gateway.tenants.authenticate("gt-some-other-key")


def test_unkeyed_registrations_move_to_hmac_when_a_secret_is_configured(r, settings, key_prefix):
    before = TenantRegistry(r, settings)              # no api_key_secret: sha256:<hex>
    _, key = before.register("acme", "vip")
    assert r.hget(Keys(key_prefix).tenant("acme"), "api_key_hash").startswith(b"sha256:")
    after = TenantRegistry(r, settings.with_(api_key_secret=SECRET))
    assert after.authenticate(key).tenant_id == "acme"
    assert r.hget(Keys(key_prefix).tenant("acme"), "api_key_hash") == hash_api_key(key, SECRET).encode()
    assert r.hkeys(Keys(key_prefix).api_keys) == [hash_api_key(key, SECRET).encode()]
    # rotating a key removes every index entry of the old one
    _, new_key = after.register("acme", "vip")
    assert r.hkeys(Keys(key_prefix).api_keys) == [hash_api_key(new_key, SECRET).encode()]
    with pytest.raises(UnknownTenant):
        after.authenticate(key)


def test_rotating_the_secret_keeps_keys_working(gateway, r, key_prefix):
    key = gateway.register_tenant("acme", "vip")
    new_secret = "the-next-secret-" + "n" * 10
    rotated = TenantRegistry(r, gateway.settings.with_(api_key_secret=new_secret,
                                                       api_key_secret_previous=SECRET))
    assert rotated.authenticate(key).tenant_id == "acme"
    assert r.hget(Keys(key_prefix).tenant("acme"), "api_key_hash") == hash_api_key(key, new_secret).encode()
    assert r.hkeys(Keys(key_prefix).api_keys) == [hash_api_key(key, new_secret).encode()]
    done = TenantRegistry(r, gateway.settings.with_(api_key_secret=new_secret))   # rotation over
    assert done.authenticate(key).tenant_id == "acme"
    with pytest.raises(UnknownTenant):      # the old secret alone no longer matches
        gateway.tenants.authenticate(key)
    assert "the-next-secret" not in repr(rotated.settings) + settings_to_json(rotated.settings.public())


@pytest.mark.parametrize("bad", ["short", "has space in it", "é-not-ascii-key", "x" * 513])
def test_chosen_api_keys_are_checked(gateway, bad):
    with pytest.raises(tenants_module.InvalidRequest):
        gateway.register_tenant("acme", "vip", api_key=bad)


def test_secrets_are_never_shown_by_settings(gateway):
    s = gateway.settings
    for shown in (repr(s), settings_to_json(s.public()), json.dumps(str(s.public()))):
        assert ADMIN_KEY not in shown and SECRET not in shown and UPSTREAM_KEY not in shown
    with pytest.raises(ConfigError) as err:
        s.with_(admin_key="too-short-12")
    assert "too-short-12" not in str(err.value) and "admin_key" in str(err.value)


# -- every route behind a credential ----------------------------------------------------
def _routes(app) -> list[tuple[str, str]]:
    """(METHOD, path template) of every application route, from the OpenAPI schema
    (which lists the routes of included routers too)."""
    return [(method.upper(), path) for path, ops in app.openapi()["paths"].items()
            for method in ops if method.upper() not in ("HEAD", "OPTIONS")]


def _concrete(path: str) -> str:
    import re
    return re.sub(r"\{[^}]+\}", "some-id", path)


def test_every_route_needs_its_credential(client, gateway):
    tenant_key = gateway.register_tenant("acme", "vip")
    routes = _routes(client.app)
    assert ("POST", "/v1/tasks") in routes and ("POST", "/v1/admin/tenants") in routes
    public = {p for _, p in routes if access_of(p) == PUBLIC}
    assert public == {"/healthz"}, public   # the only application route open to anyone
    for method, path in routes:
        url = _concrete(path)
        access = access_of(path)
        if access == PUBLIC:
            continue
        wrong = ADMIN_KEY if access == TENANT else tenant_key
        for headers in ({}, auth("gt-not-a-key"), {"Authorization": "Basic YTpi"}, auth(wrong)):
            resp = client.request(method, url, headers=headers, json={})
            assert resp.status_code == 401, (method, url, headers, resp.text)
            assert resp.json()["error"]["type"] == "Unauthorized"
        right = ADMIN_KEY if access == ADMIN else tenant_key
        resp = client.request(method, url, headers=auth(right), json={})
        assert resp.status_code != 401, (method, url, resp.text)
    # a route that does not exist needs a credential too (deny by default: no route probing)
    assert client.get("/v2/anything").status_code == 401
    assert client.get("/v2/anything", headers=auth(tenant_key)).status_code == 404
    assert access_of("/metrics") == ADMIN and access_of("/v1/crons") == TENANT


def test_admin_api_is_off_without_an_admin_key(r, settings):
    gw = Gateway(settings)
    try:
        with TestClient(create_app(gw)) as c:
            resp = c.get("/v1/admin/tenants", headers=auth("anything-at-all-here"))
            assert resp.status_code == 401 and "GATEWAY_ADMIN_KEY" in resp.json()["error"]["message"]
            assert c.get("/metrics").status_code == 401
    finally:
        gw.app.close()
        gw.r.close()


# -- tenant isolation --------------------------------------------------------------------
def _has(client, method: str, path: str) -> bool:
    return (method, path) in _routes(client.app)


def test_tenant_a_cannot_read_cancel_or_list_tenant_bs_tasks_or_crons(client, gateway):
    key_a = gateway.register_tenant("alpha", "vip")
    key_b = gateway.register_tenant("beta", "vip")
    resp = client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(key_a))
    assert resp.status_code == 202, resp.text
    task_id = resp.json()["task_id"]
    unknown = "00000000-0000-4000-8000-000000000000"
    own = client.get(f"/v1/tasks/{task_id}", headers=auth(key_a))
    assert own.status_code == 200 and own.json()["status"] == "PENDING"
    theirs = client.get(f"/v1/tasks/{task_id}", headers=auth(key_b))
    nothing = client.get(f"/v1/tasks/{unknown}", headers=auth(key_b))
    assert theirs.status_code == nothing.status_code == 404          # 404, not 403
    assert theirs.json()["error"]["type"] == nothing.json()["error"]["type"] == "NotFound"
    assert task_id not in json.dumps(nothing.json())
    if _has(client, "DELETE", "/v1/tasks/{task_id}"):                # cancel
        assert client.delete(f"/v1/tasks/{task_id}", headers=auth(key_b)).status_code == 404
        assert client.get(f"/v1/tasks/{task_id}", headers=auth(key_a)).json()["status"] == "PENDING"
    if _has(client, "GET", "/v1/tasks"):                               # listing, if there is one
        listed = client.get("/v1/tasks", headers=auth(key_b))
        assert task_id not in listed.text
    if _has(client, "POST", "/v1/crons"):                              # tenant crons
        made = client.post("/v1/crons", headers=auth(key_a),
                           json={"task_id": "digest", "cron": "0 * * * *",
                                 "messages": [{"role": "user", "content": "Summarise"}]})
        assert made.status_code in (200, 201), made.text
        assert "digest" not in client.get("/v1/crons", headers=auth(key_b)).text
        for method in ("GET", "DELETE"):
            if _has(client, method, "/v1/crons/{task_id}"):
                resp = client.request(method, "/v1/crons/digest", headers=auth(key_b))
                assert resp.status_code == 404, resp.text
        assert "digest" in client.get("/v1/crons", headers=auth(key_a)).text


# -- admin routes ------------------------------------------------------------------------
def test_admin_registers_lists_and_deletes_tenants(client, gateway, r, key_prefix):
    admin = auth(ADMIN_KEY)
    resp = client.post("/v1/admin/tenants", headers=admin,
                       json={"tenant_id": "acme", "tier": "enterprise", "weight": 2})
    assert resp.status_code == 201, resp.text
    made = resp.json()
    assert made["tier"] == "vip" and made["weight"] == 2.0 and made["api_key"].startswith("gt-")
    key = made["api_key"]
    assert client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(key)).status_code == 202
    listed = client.get("/v1/admin/tenants", headers=admin)
    assert [t["tenant_id"] for t in listed.json()["tenants"]] == ["acme"]
    assert key not in listed.text and "hash" not in listed.text
    assert client.get("/v1/admin/tenants/acme", headers=admin).json()["tier"] == "vip"
    assert client.get("/v1/admin/tenants/nobody", headers=admin).status_code == 404
    for bad in ({"tenant_id": "a|b", "tier": "vip"}, {"tenant_id": "x", "tier": "gold"},
                {"tenant_id": "x", "tier": "vip", "api_key": "short"}, {"tier": "vip"}):
        resp = client.post("/v1/admin/tenants", headers=admin, json=bad)
        assert resp.status_code == 400, (bad, resp.text)
    assert client.delete("/v1/admin/tenants/acme", headers=admin).json() == {
        "deleted": "acme", "crons_deleted": 0, "tasks_cancelled": 1}    # its task above, still queued
    assert client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(key)).status_code == 401
    assert client.delete("/v1/admin/tenants/acme", headers=admin).status_code == 404
    assert key.encode() not in all_stored_bytes(r, key_prefix)


def test_admin_settings_show_no_secret(client, gateway):
    resp = client.get("/v1/admin/settings", headers=auth(ADMIN_KEY))
    assert resp.status_code == 200
    body = resp.json()
    assert body["key_prefix"] == gateway.settings.key_prefix and body["pools"][0]["name"] == "default"
    for secret in (ADMIN_KEY, SECRET, UPSTREAM_KEY):
        assert secret not in resp.text
