"""CronStore and the Python API against the real Redis."""

from __future__ import annotations

import hashlib
import json

import pytest

from beat.api import delete_cron, list_crons, register_cron
from beat.schedule import iso_utc
from beat.store import CronSpec, CronStore
from gateway_tasks.core.errors import CronError, UnknownTenant
from gateway_tasks.core.keys import Keys
from gateway_tasks.tenants.registry import TenantRegistry

T0 = 1_709_287_380_000          # 2024-03-01T10:03:00Z
HOUR = 3_600_000
T10 = T0 - 3 * 60_000           # 10:00
PAYLOAD = {"messages": [{"role": "user", "content": "Summarise the news"}], "max_tokens": 64}


def offset(tenant, task, window):
    return int(hashlib.sha256(f"{tenant}:{task}".encode()).hexdigest(), 16) % window if window else 0


@pytest.fixture
def store(r, settings):
    reg = TenantRegistry(r, settings)
    reg.register("acme", "free")
    reg.register("bigco", "enterprise")
    reg.register("midco", "pro")
    return CronStore(r, settings)


def test_add_writes_hash_payload_sorted_set_and_tenant_set(r, settings, store):
    e = store.add("acme", "digest", "0 * * * *", PAYLOAD, now=T0)
    k = Keys(settings.key_prefix)
    assert e.entry_id == "acme:digest"
    assert e.tier == "batch" and e.window_s == 600 and e.period_s == 3600
    assert e.jitter_offset_s == offset("acme", "digest", 600)
    assert r.zscore(k.cron_due, "acme:digest") == e.next_fire_ms
    assert e.next_fire_ms == e.next_nominal_ms + e.jitter_offset_s * 1000
    assert r.smembers(k.cron_tenant("acme")) == {b"acme:digest"}
    assert json.loads(r.get(k.cron_payload("acme:digest"))) == PAYLOAD
    raw = {k.decode(): v.decode() for k, v in r.hgetall(k.cron("acme:digest")).items()}
    assert raw["cron"] == "0 * * * *" and raw["timezone"] == "UTC" and "payload" not in raw
    # compact: Redis 7 calls its small-hash encoding listpack, Redis 6 ziplist
    assert r.object("encoding", k.cron("acme:digest")) in (b"listpack", b"ziplist")
    assert store.get("acme", "digest").payload == PAYLOAD


@pytest.mark.parametrize("tenant,tier_window", [("acme", 600), ("midco", 120), ("bigco", 0)])
def test_jitter_window_comes_from_the_tenant_tier(store, tenant, tier_window):
    e = store.add(tenant, "job", "0 * * * *", PAYLOAD, now=T0)
    assert e.jitter_offset_s == offset(tenant, "job", tier_window)


def test_first_run_is_the_next_whose_jittered_time_is_ahead(store):
    e = store.add("bigco", "job", "0 * * * *", PAYLOAD, now=T0)       # no jitter
    assert e.next_nominal_ms == T10 + HOUR


def test_unknown_tenant(store):
    with pytest.raises(UnknownTenant, match="nobody"):
        store.add("nobody", "job", "0 * * * *", PAYLOAD, now=T0)


def test_malformed_cron_names_expression_and_writes_nothing(r, settings, store):
    with pytest.raises(CronError, match=r"malformed cron expression '0 25 \* \* \*'.*"):
        store.add("acme", "job", "0 25 * * *", PAYLOAD, now=T0)
    assert store.count() == 0 and store.get("acme", "job") is None


@pytest.mark.parametrize("task_id", ["", "has space", "a:b", "x" * 129, None])
def test_bad_task_ids(store, task_id):
    with pytest.raises(CronError, match="task id"):
        store.add("acme", task_id, "0 * * * *", PAYLOAD, now=T0)


@pytest.mark.parametrize("payload,match", [
    ({}, "non-empty 'messages'"),
    ({"messages": []}, "non-empty 'messages'"),
    ({"messages": "hi"}, "non-empty 'messages'"),
    ({"messages": [{"content": "x"}]}, r"messages\[0\]"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 1}, "unknown keys"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "model": ""}, "model"),
    ("not a dict", "must be an object"),
])
def test_bad_payloads(store, payload, match):
    with pytest.raises(CronError, match=match):
        store.add("acme", "job", "0 * * * *", payload, now=T0)


def test_tenant_named_like_a_key_segment_owns_crons(r, settings):
    # entry keys and per-tenant index keys live in different namespaces
    TenantRegistry(r, settings).register("tenant", "free")
    TenantRegistry(r, settings).register("due", "free")
    store = CronStore(r, settings)
    store.add("tenant", "job", "0 * * * *", PAYLOAD, now=T0)
    store.add("due", "job", "0 * * * *", PAYLOAD, now=T0)
    assert [e.task_id for e in store.list("tenant")] == ["job"]
    assert [e.task_id for e in store.list("due")] == ["job"]


def test_update_keeps_history_and_never_reschedules_a_settled_run(r, settings, store):
    k = Keys(settings.key_prefix)
    first = store.add("bigco", "job", "0 * * * *", PAYLOAD, now=T0)
    # pretend the 11:00 run fired
    r.hset(k.cron("bigco:job"), mapping={"settled_nominal_ms": first.next_nominal_ms,
                                         "last_status": "fired", "last_task_id": "t-1"})
    again = store.add("bigco", "job", "0 * * * *", PAYLOAD, now=T0)
    assert again.next_nominal_ms == first.next_nominal_ms + HOUR
    changed = store.add("bigco", "job", "*/5 * * * *", {"messages": [{"role": "user", "content": "y"}]},
                        now=T0)
    assert changed.next_nominal_ms == first.next_nominal_ms + 5 * 60_000
    got = store.get("bigco", "job")
    assert got.cron == "*/5 * * * *" and got.last_task_id == "t-1" and got.created_ms == T0
    assert got.payload == {"messages": [{"role": "user", "content": "y"}]}
    assert store.count() == 1


def test_delete(r, settings, store):
    store.add("acme", "a", "0 * * * *", PAYLOAD, now=T0)
    store.add("acme", "b", "0 * * * *", PAYLOAD, now=T0)
    assert store.delete("acme", "a") is True
    assert store.delete("acme", "a") is False
    k = Keys(settings.key_prefix)
    assert not r.exists(k.cron("acme:a"), k.cron_payload("acme:a"))
    assert r.zscore(k.cron_due, "acme:a") is None
    assert r.smembers(k.cron_tenant("acme")) == {b"acme:b"}


def test_due_is_earliest_first_and_limited(store):
    store.add("bigco", "hourly", "0 * * * *", PAYLOAD, now=T0)     # 11:00
    store.add("bigco", "fivemin", "*/5 * * * *", PAYLOAD, now=T0)  # 10:05
    store.add("bigco", "daily", "0 0 * * *", PAYLOAD, now=T0)      # tomorrow
    assert store.due(T0, 10) == []
    assert store.due(T10 + HOUR, 10) == [("bigco:fivemin", T10 + 5 * 60_000),
                                         ("bigco:hourly", T10 + HOUR)]
    assert store.due(T10 + HOUR, 1) == [("bigco:fivemin", T10 + 5 * 60_000)]
    assert store.next_fire_ms() == T10 + 5 * 60_000


def test_add_many(r, settings, store):
    n = store.add_many([CronSpec("acme", f"c{i}", "0 * * * *", PAYLOAD) for i in range(30)]
                       + [CronSpec("bigco", "x", "*/5 * * * *", PAYLOAD)], now=T0, chunk=7)
    assert n == 31 and store.count() == 31
    assert store.get("acme", "c3") == store.build("acme", "c3", "0 * * * *", PAYLOAD, "batch", T0)
    with pytest.raises(UnknownTenant):
        store.add_many([CronSpec("ghost", "c", "0 * * * *", PAYLOAD)], now=T0)


def test_api_register_list_delete(r, settings, store):
    row = register_cron(settings, r, "acme", "digest", "0 * * * *", PAYLOAD, now_ms=T0)
    off = offset("acme", "digest", 600)
    nominal = T10 if off > 180 else T10 + HOUR
    assert row == {
        "tenant_id": "acme", "task_id": "digest", "cron": "0 * * * *", "tier": "batch",
        "jitter_offset_s": off, "nominal_next": iso_utc(nominal),
        "actual_next": iso_utc(nominal + off * 1000), "last_fired": None, "last_status": None,
        "last_task_id": None, "retry_at": None,
    }
    register_cron(settings, r, "bigco", "b", "@daily", PAYLOAD, now_ms=T0)
    assert [x["task_id"] for x in list_crons(settings, r)] == ["digest", "b"]
    assert [x["task_id"] for x in list_crons(settings, r, "bigco")] == ["b"]
    assert list_crons(settings, r, "nobody") == []
    assert delete_cron(settings, r, "acme", "digest") is True
    with pytest.raises(CronError, match="has no cron 'digest'"):
        delete_cron(settings, r, "acme", "digest")
