"""Quotas on every submit path: the tier's max_tasks_per_hour (seed defaults 10 / 60 /
500 for free / pro / enterprise) and the optional per-tenant TPM bucket, taken
atomically at submit -- parallel submits never exceed them -- with QuotaExceeded
naming the quota, its reset and retry_after_s, in Python and over REST."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from beat.entry import CronEntry
from beat.fire import gateway_fire
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.errors import PromptTooLarge, QueueFull, QuotaExceeded
from gateway_tasks.core.keys import Keys
from gateway_tasks.tenants.quota import HOUR_MS, effective_tpm, hour_of, hour_reset_s, reset_iso
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("free1", "free"), ("pro1", "pro"), ("ent1", "enterprise")])


def queued(gw: Gateway, tier: str) -> int:
    return len(queued_messages(gw.r, Keys(gw.settings.key_prefix), "default", tier))


def hour_count(gw: Gateway, tenant: str) -> int:
    return int(gw.r.get(Keys(gw.settings.key_prefix).quota(tenant, hour_of(redis_now_ms(gw.r)))) or 0)


@pytest.mark.parametrize("now_ms,reset_s", [(0, 3600.0), (HOUR_MS - 1, 0.001), (HOUR_MS + 1_800_000, 1800.0)])
def test_hour_reset_is_the_next_clock_hour(now_ms, reset_s):
    assert hour_reset_s(now_ms) == pytest.approx(reset_s)
    assert hour_of(now_ms + int(reset_s * 1000)) == hour_of(now_ms) + 1


def test_reset_iso_and_effective_tpm():
    assert reset_iso(0, 3600) == "1970-01-01T01:00:00Z"
    assert (effective_tpm(0, 0), effective_tpm(0, 500), effective_tpm(200, 500)) == (0, 500, 200)


def test_seed_defaults_per_tier(settings):
    assert [(settings.tier(n).name, settings.tier(n).max_tasks_per_hour)
            for n in ("free", "pro", "enterprise")] == [("batch", 10), ("normal", 60), ("vip", 500)]


def test_the_hourly_quota_refuses_the_next_submit_with_its_reset(gw):
    for i in range(10):
        gw.submit("free1", f"task {i}", max_tokens=5)
    with pytest.raises(QuotaExceeded, match=r"quota of 10 tasks per hour .* resets at") as info:
        gw.submit("free1", "one too many", max_tokens=5)
    assert info.value.reason == "tasks_per_hour"
    assert 0 < info.value.retry_after_s <= 3600
    assert info.value.retry_after_s == pytest.approx(hour_reset_s(redis_now_ms(gw.r)), abs=2)
    assert queued(gw, "batch") == 10 and hour_count(gw, "free1") == 10
    gw.submit("pro1", "another tenant is not affected", max_tokens=5)


def test_parallel_submits_never_exceed_the_quota(gw):
    def one(i: int) -> str:
        try:
            gw.submit("pro1", f"parallel {i}", max_tokens=5)
            return "ok"
        except QuotaExceeded:
            return "quota"

    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(one, range(100)))
    assert outcomes.count("ok") == 60 and outcomes.count("quota") == 40
    assert queued(gw, "normal") == 60 and hour_count(gw, "pro1") == 60


def test_a_refused_enqueue_gives_its_quota_back(gw):
    tiers = tuple(replace(t, queue_max_len=2) if t.name == "batch" else t for t in gw.settings.tiers)
    g = Gateway(gw.settings.with_(tiers=tiers), client=gw.r)
    g.submit("free1", "one", max_tokens=5)
    g.submit("free1", "two", max_tokens=5)
    with pytest.raises(QueueFull):
        g.submit("free1", "three", max_tokens=5)
    assert hour_count(g, "free1") == 2


def test_cron_fires_and_api_submits_share_one_counter(gw):
    """beat counts a fire when it claims the run; the submit it makes does not count it again,
    and API submits count in the same counter, so the tier's limit holds for both."""
    keys = Keys(gw.settings.key_prefix)
    gw.r.set(keys.quota("free1", hour_of(redis_now_ms(gw.r))), 9)    # 9 cron fires this hour
    entry = CronEntry("free1", "nightly", "* * * * *", {"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 5},
                      "batch", window_s=0, period_s=60, jitter_offset_s=0, next_nominal_ms=60_000,
                      next_fire_ms=60_000)
    gateway_fire(gw.settings, app=gw.app, client=gw.r)(entry, 60_000)
    assert hour_count(gw, "free1") == 9
    gw.submit("free1", "the tenth", max_tokens=5)
    with pytest.raises(QuotaExceeded):
        gw.submit("free1", "the eleventh", max_tokens=5)


def test_tenant_tpm_bucket(gw):
    gw.register_tenant("metered", "vip", tpm=300)
    first = gw.submit("metered", "hello", max_tokens=200)
    with pytest.raises(QuotaExceeded, match="TPM quota") as info:
        gw.submit("metered", "hello", max_tokens=200)
    assert info.value.reason == "tenant_tpm"
    # the bucket holds 300 - first.est_tokens and refills 5 tokens/s
    missing = first.est_tokens * 2 - 300
    assert info.value.retry_after_s == pytest.approx(missing / 5.0, rel=0.1)
    assert queued(gw, "vip") == 1 and hour_count(gw, "metered") == 1   # the refused one took nothing
    with pytest.raises(PromptTooLarge, match="TPM quota of 300"):
        gw.submit("metered", "hello", max_tokens=400)


def test_a_cancelled_task_gives_its_tenants_tpm_tokens_back(gw):
    """Removed while queued (or held on its depends_on) it never runs: its estimate goes
    back to its tenant's TPM bucket, so the next submit fits."""
    gw.register_tenant("metered", "vip", tpm=300)
    first = gw.submit("metered", "hello", max_tokens=200)
    with pytest.raises(QuotaExceeded, match="TPM quota"):
        gw.submit("metered", "hello", max_tokens=200)
    assert gw.cancel(first.id).was == "queued"
    second = gw.submit("metered", "hello", max_tokens=200)      # fits again
    held = gw.submit("metered", "after it", max_tokens=5, depends_on=[second.id])
    tokens = float(gw.r.hget(Keys(gw.settings.key_prefix).tenant_bucket("metered"), "tokens"))
    assert gw.cancel(held.id).was == "waiting"
    after = float(gw.r.hget(Keys(gw.settings.key_prefix).tenant_bucket("metered"), "tokens"))
    assert after == pytest.approx(min(300, tokens + held.est_tokens), abs=1.0)
    assert gw.cancel(second.id).was == "queued"
    assert float(gw.r.hget(Keys(gw.settings.key_prefix).tenant_bucket("metered"), "tokens")) == pytest.approx(300, abs=1.0)


def test_tier_tenant_tpm_applies_to_every_tenant_of_the_tier(gw):
    tiers = tuple(replace(t, tenant_tpm=250) if t.name == "normal" else t for t in gw.settings.tiers)
    g = Gateway(gw.settings.with_(tiers=tiers), client=gw.r)
    g.submit("pro1", "hi", max_tokens=200)
    with pytest.raises(QuotaExceeded, match="250 tokens per minute"):
        g.submit("pro1", "hi", max_tokens=200)
    g.submit("ent1", "another tier is not metered", max_tokens=200)


def test_rest_answers_429_with_the_quota_reason_and_reset(gw):
    key = gw.register_tenant("free2", "free")
    with TestClient(create_app(gw)) as client:
        for i in range(10):
            assert client.post("/v1/tasks", json={"messages": [{"role": "user", "content": f"q{i}"}]},
                               headers={"Authorization": f"Bearer {key}"}).status_code == 202
        res = client.post("/v1/tasks", json={"messages": [{"role": "user", "content": "again"}]},
                          headers={"Authorization": f"Bearer {key}"})
    assert res.status_code == 429
    err = res.json()["error"]
    assert err["type"] == "QuotaExceeded" and err["reason"] == "tasks_per_hour"
    assert 0 < err["retry_after_s"] <= 3600 and "resets at" in err["message"]
    assert 1 <= int(res.headers["Retry-After"]) <= 3600
    assert abs(int(res.headers["Retry-After"]) - err["retry_after_s"]) <= 1


# -- the estimate made ahead (Submission's Guess): a submit after the first one of a tenant sends
# its quota take in the claim's round trip, estimated from the last read of the tenant and level
def test_a_tenant_changed_since_the_last_submit_is_taken_for_at_its_new_tier(gw):
    gw.register_tenant("mover", "vip", tpm=600)
    gw.submit("mover", "first", max_tokens=50)            # read: vip
    gw.register_tenant("mover", "batch", tpm=600)         # the next estimate made ahead is stale
    tokens = float(gw.r.hget(gw.keys.tenant_bucket("mover"), "tokens"))
    second = gw.submit("mover", "second", max_tokens=50)
    assert second.tier == "batch" and queued(gw, "batch") == 1
    assert hour_count(gw, "mover") == 2                    # the stale take was given back: one count each
    after = float(gw.r.hget(gw.keys.tenant_bucket("mover"), "tokens"))
    assert after == pytest.approx(tokens - second.est_tokens, abs=3.0)   # (10 tokens/s refill)


def test_a_load_level_risen_since_the_last_submit_is_applied(gw):
    gw.register_tenant("capped", "free", tpm=6_000)    # free (batch) is capped at 2048 from L1
    first = gw.submit("capped", "hello", max_tokens=3000)
    gw.r.hset(gw.keys.overload_state, mapping={"level": 1, "reason": "test: pool saturated"})
    try:
        tokens = float(gw.r.hget(gw.keys.tenant_bucket("capped"), "tokens"))
        second = gw.submit("capped", "hello", max_tokens=3000)
        after = float(gw.r.hget(gw.keys.tenant_bucket("capped"), "tokens"))
    finally:
        gw.r.hset(gw.keys.overload_state, "level", 0)
    assert second.est_tokens < first.est_tokens            # degraded at L1: max_tokens capped
    assert after == pytest.approx(tokens - second.est_tokens, abs=3.0)   # (100 tokens/s refill)
    assert hour_count(gw, "capped") == 2


def test_a_quota_refused_in_the_claims_round_trip_enqueues_nothing_and_takes_nothing(gw):
    for i in range(10):                                    # the 2nd to 10th take ride with the claim
        gw.submit("free1", f"task {i}", max_tokens=5)
    with pytest.raises(QuotaExceeded) as info:
        gw.submit("free1", "one too many", max_tokens=5)
    assert info.value.reason == "tasks_per_hour"
    assert queued(gw, "batch") == 10 and hour_count(gw, "free1") == 10


def test_a_gateway_keeps_a_bounded_number_of_tenants_last_reads(monkeypatch):
    from gateway_tasks.producer import submission
    monkeypatch.setattr(submission, "LAST_VIEWS_MAX", 3)
    views: dict = {}
    for i in range(5):
        submission.remember_view(views, f"t{i}", i)
    submission.remember_view(views, "t3", 33)          # an update keeps its place
    assert views == {"t2": 2, "t3": 33, "t4": 4}
