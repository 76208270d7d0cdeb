"""`gateway migrate-keys`: a deployment upgrading from the key names of the releases before
the cluster layout keeps everything it had -- its tenants and their keys, quotas, crons,
held and deferred tasks, cancel marks.  Today's records are put back under the old names
(spelled here as those releases spelled them), then moved: a dry run moves nothing, --apply
moves them with their TTLs, everything works again, a second run finds nothing, and a key
whose new name exists already is left and listed."""

from __future__ import annotations

import json

import pytest

from beat.store import CronStore
from gateway_tasks.cli.main import main
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.errors import UnknownTenant
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.lifecycle import depends
from gateway_tasks.overload import deferral
from gateway_tasks.overload.actions import Action
from gateway_tasks.core.settings import DEFER, get_settings
from gateway_tasks.tenants.quota import hour_of

PAYLOAD = {"messages": [{"role": "user", "content": "the nightly digest"}], "max_tokens": 5}


@pytest.fixture
def env(monkeypatch, redis_url, key_prefix):
    monkeypatch.delenv("GATEWAY_CONFIG", raising=False)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("GATEWAY_KEY_PREFIX", key_prefix)
    get_settings.cache_clear()       # the command's settings: this test's
    yield
    get_settings.cache_clear()


def migrate(capsys, *argv: str) -> tuple[int, dict]:
    status = main(["migrate-keys", *argv])
    return status, json.loads(capsys.readouterr().out)


def test_an_old_layout_is_moved_and_everything_works_again(env, make_gateway, r, key_prefix, capsys):
    gw = make_gateway([("acme", "vip")])
    k, p = gw.keys, key_prefix
    api_key = gw.register_tenant("metered", "vip", api_key="metered-key-123", tpm=10_000)
    gw.submit("metered", "takes tokens and a task of the hour", max_tokens=5)
    a = gw.submit("acme", "a dependency", max_tokens=5)
    child = gw.submit("acme", "held on it", max_tokens=5, depends_on=[a.id])
    doomed = gw.submit("acme", "cancelled while queued", max_tokens=5)
    assert gw.cancel(doomed.id).was == "queued"
    store = CronStore(gw.r, gw.settings, gateway=gw)
    store.add("acme", "nightly", "0 3 * * *", PAYLOAD)
    spec = json.dumps({"task_id": "deferred-1", "queue": gw.settings.queue_name("batch", "default"),
                       "body": {"pool": "default", "tenant_id": "acme", "est_tokens": 5}})
    deferral.hold(gw.r, k, "deferred-1", "batch", "default", spec,
                  Action(DEFER, 3, "batch", 0, retry_after_s=60, reason="capacity_pressure"),
                  10**13, 10**13 - 60_000, 600)
    hour = hour_of(redis_now_ms(r))
    # today's records under the names the releases before the cluster layout used
    old = {
        k.tenant("acme"): f"{p}tenant:acme", k.tenant("metered"): f"{p}tenant:metered",
        k.quota("metered", hour): f"{p}quota:metered:{hour}", k.tenant_bucket("metered"): f"{p}tenant-bucket:metered",
        k.cron("acme:nightly"): f"{p}cron:acme:nightly", k.cron_payload("acme:nightly"): f"{p}cron:payload:acme:nightly",
        k.cron_due: f"{p}cron:due", k.cron_tenant("acme"): f"{p}cron-tenant:acme",
        k.held(child.id): f"{p}{{deps}}:held:{child.id}", k.waiters(a.id): f"{p}{{deps}}:waiters:{a.id}",
        k.held("deferred-1"): f"{p}{{deps}}:held:deferred-1", k.cancelled(doomed.id): f"{p}cancelled:{doomed.id}",
    }
    for new, legacy in old.items():
        r.rename(new, legacy)
    r.rename(k.deferred("default", "batch"), f"{p}{{deps}}:deferred:batch")
    r.hset(f"{p}cron:stats", "fired", 12)
    r.set(f"{p}cron:fired:acme:nightly:1700000000000", 1, px=3_600_000)
    with pytest.raises(UnknownTenant):
        gw.tenants.authenticate(api_key)                       # not found under today's names

    status, dry = migrate(capsys)
    assert status == 0 and dry["applied"] is False and dry["conflicts"] == []
    assert dry["to_move"] == {"cancelled": 1, "cron": 1, "cron_due": 1, "cron_fired": 1, "cron_payload": 1,
                              "cron_stats": 1, "held": 2, "quota": 1, "tenant": 2, "tenant_crons": 1,
                              "tpm_bucket": 1, "waiters": 1}
    assert dry["deferred_tasks"] == 1 and all(r.exists(legacy) for legacy in old.values())

    status, done = migrate(capsys, "--apply")
    assert status == 0 and done["moved"] == dry["to_move"] and done["deferred_tasks"] == 1
    assert not any(r.exists(legacy) for legacy in old.values()) and not r.exists(f"{p}{{deps}}:deferred:batch")
    assert 0 < r.pttl(k.quota("metered", hour)) and r.pttl(k.cancelled(doomed.id)) > 0     # TTLs kept
    assert gw.tenants.authenticate(api_key).tenant_id == "metered"
    assert [t.tenant_id for t in gw.tenants.list()] == ["acme", "metered"]
    assert int(r.get(k.quota("metered", hour))) == 1 and r.exists(k.tenant_bucket("metered"))
    assert [e.task_id for e in store.list("acme")] == ["nightly"] and store.next_fire_ms()
    assert int(r.hget(k.cron_stats, "fired")) == 12
    assert gw.cancel(doomed.id).was == "already_cancelled"
    assert deferral.held_counts(r, k, gw.settings.tiers, ["default"])["batch"] == 1
    assert depends.finish(gw.app, gw.r, k, 60, a.id, ok=True) == 1            # the held task released
    assert child.id in [m["headers"]["id"] for m in queued_messages(gw.r, k, "default", "vip")]

    status, again = migrate(capsys, "--apply")
    assert status == 0 and again["moved"] == {} and again["deferred_tasks"] == 0   # nothing left to move


def test_a_key_whose_new_name_exists_is_left_and_listed(env, make_gateway, r, key_prefix, capsys):
    gw = make_gateway([("acme", "vip")])
    r.hset(f"{key_prefix}tenant:acme", mapping={"tier": "batch"})   # an old record beside today's
    status, dry = migrate(capsys)
    assert status == 1 and dry["conflicts"] == [f"{key_prefix}tenant:acme"]
    status, done = migrate(capsys, "--apply")
    assert status == 1 and done["conflicts"] == [f"{key_prefix}tenant:acme"] and done["moved"] == {}
    assert r.exists(f"{key_prefix}tenant:acme") and gw.tenants.get("acme").tier == "vip"
