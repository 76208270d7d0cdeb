"""Between tiers (gateway_tasks/dispatch/priority.py): the aging presets' score maths, table-tested,
and both rules in lua/dispatch/pick.lua against a real Redis -- the capped preset's bands, and an
urgent task lifted across tiers by its band less 1500 (VIP work first when it is older or an
urgent task is batch), charged to its own tier."""

from __future__ import annotations

import pytest

from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Settings, load_settings
from gateway_tasks.dispatch.deadline import DeadlineCall
from gateway_tasks.dispatch.priority import (CAPPED_BONUS_MAX, NO_CAP, NOT_LIFTED, aging_score, aging_terms, bands,
                                             priorities, urgent_band)
from gateway_tasks.dispatch.router import PickPlan, Picked
from tests.test_pick_lifecycle import BIG, pick, push

WEIGHTS = {"vip": 100.0, "normal": 20.0, "batch": 1.0}


def test_bands_by_tier_rank_and_the_urgent_lift():
    assert bands(WEIGHTS) == {"vip": 0, "normal": 1000, "batch": 2000}
    assert bands({"a": 5.0, "b": 5.0, "c": 1.0}) == {"a": 0, "b": 0, "c": 1000}
    assert [urgent_band(b) for b in (0, 1000, 2000, 3000)] == [0, 0, 500, 1500]
    assert priorities(WEIGHTS, True) == {"vip": (0, 0), "normal": (1000, 0), "batch": (2000, 500)}
    assert priorities(WEIGHTS, False) == {"vip": (0, NOT_LIFTED), "normal": (1000, NOT_LIFTED),
                                          "batch": (2000, NOT_LIFTED)}


@pytest.mark.parametrize("preset,weight,alpha,band,wait_ms,expected", [
    ("linear", 100, 0.05, 0, 0, 100.0),                 # a fresh VIP task
    ("linear", 1, 0.005, 2000, 19_800, 100.0),          # batch catches up with fresh VIP after 19.8 s
    ("linear", 1, 0.005, 2000, 3_600_000, 18_001.0),    # and keeps climbing: no cap
    ("capped", 100, 0.05, 0, 0, 0.0),                   # VIP's band 0
    ("capped", 20, 0.02, 1000, 60_000, -900.0),         # +100 per 60 s
    ("capped", 20, 0.02, 1000, 30_000, -950.0),         # ... pro rata
    ("capped", 1, 0.005, 2000, 480_000, -1200.0),       # 8 min: the cap, 800
    ("capped", 1, 0.005, 2000, 3_600_000, -1200.0),     # an hour: still 800
    ("capped", 1, 0.005, 2000, -5, -2000.0),            # a clock step back: no negative wait
])
def test_aging_presets_score(preset, weight, alpha, band, wait_ms, expected):
    assert aging_score(*aging_terms(preset, weight, alpha, band), wait_ms) == pytest.approx(expected)


def test_capped_bands_never_cross_and_linear_ones_do():
    capped_batch = aging_score(*aging_terms("capped", 1, 0.005, 2000), 10**9)
    assert capped_batch < aging_score(*aging_terms("capped", 20, 0.02, 1000), 0)
    assert aging_score(*aging_terms("linear", 1, 0.005, 2000), 10**9) > aging_score(*aging_terms("linear", 100, 0.05, 0), 0)
    assert aging_terms("capped", 1, 0.005, 2000)[2] == CAPPED_BONUS_MAX
    assert aging_terms("linear", 1, 0.005, 2000)[2] == NO_CAP


@pytest.mark.parametrize("env,match", [({"GATEWAY_AGING": "log"}, "aging"),
                                       ({"GATEWAY_SETTINGS_JSON": '{"deadline_boost_across_tiers": "yes"}'},
                                        "deadline_boost_across_tiers")])
def test_bad_settings_fail_fast(env, match):
    with pytest.raises(ConfigError, match=match):
        load_settings(env=env)


def plan_of(settings: Settings, **changes) -> tuple[Settings, PickPlan]:
    s = settings.with_(pools=(BIG,), **changes)
    return s, PickPlan(s, s.queue_names())


def order(r, plan: PickPlan, n: int) -> list[str]:
    out = []
    for _ in range(n):
        got = pick(r, plan)
        assert isinstance(got, Picked), got
        out.append(f"{got.tier}:{got.tenant}")
    return out


@pytest.mark.parametrize("preset,expected", [
    ("capped", ["vip:new-vip", "normal:new-normal", "batch:old-batch"]),   # 0 > 1000 - 0 > 2000 - 800
    ("linear", ["batch:old-batch", "vip:new-vip", "normal:new-normal"]),   # 1 + 0.005 x 3.6e6 > 100 > 20
])
def test_the_aging_policy_orders_tiers_by_its_preset(r, settings, preset, expected):
    s, plan = plan_of(settings, policy="aging", aging=preset)
    now = redis_now_ms(r)
    push(r, s, "batch", "old-batch", enq_ms=now - 3_600_000)   # an hour
    push(r, s, "normal", "new-normal", enq_ms=now)
    push(r, s, "vip", "new-vip", enq_ms=now)
    assert order(r, plan, 3) == expected


def urgent(r, s: Settings, tier: str, tenant: str, enq_ms: int) -> None:
    _, entry = push(r, s, tier, tenant, enq_ms=enq_ms)
    scripts_for(r).run(DeadlineCall(Keys(s.key_prefix), "default", tier, redis_now_ms(r) - 1, entry))


def test_an_urgent_batch_task_goes_after_vip_work_before_normal_work(r, settings):
    s, plan = plan_of(settings, policy="wfq")
    now = redis_now_ms(r)
    for i in range(3):
        push(r, s, "normal", f"n{i}", enq_ms=now - 10_000)
    push(r, s, "vip", "v0", enq_ms=now)
    urgent(r, s, "batch", "b-urgent", now)
    push(r, s, "batch", "b-plain", enq_ms=now - 10_000)
    got = order(r, plan, 3)
    assert got[:2] == ["vip:v0", "batch:b-urgent"]
    assert got[2].startswith("normal:")


def test_an_urgent_normal_task_goes_with_vip_work_the_older_first(r, settings):
    s, plan = plan_of(settings, policy="wfq")
    now = redis_now_ms(r)
    push(r, s, "vip", "v-new", enq_ms=now)
    urgent(r, s, "normal", "n-urgent", now - 1_000)          # older than the VIP task: first
    push(r, s, "vip", "v-newer", enq_ms=now)
    assert order(r, plan, 2) == ["normal:n-urgent", "vip:v-new"]
    urgent(r, s, "normal", "n-urgent2", now + 5_000)          # newer than VIP's: after it
    assert order(r, plan, 2) == ["vip:v-newer", "normal:n-urgent2"]


@pytest.mark.parametrize("across,expected", [(True, ["normal:n-urgent", "vip:v0"]),
                                               (False, ["vip:v0", "vip:v1"])])
def test_with_the_lift_off_an_urgent_task_stays_in_its_tier(r, settings, across, expected):
    s, plan = plan_of(settings, policy="strict", deadline_boost_across_tiers=across)
    now = redis_now_ms(r)
    for i in range(2):
        push(r, s, "vip", f"v{i}", enq_ms=now)
    urgent(r, s, "normal", "n-urgent", now - 1_000)   # older than the VIP tasks (within the TTL)
    assert order(r, plan, 2) == expected


def test_a_lifted_dispatch_is_charged_to_its_own_tier(r, settings):
    # the lifted batch task moves batch's finish tag, not the pool's virtual time
    s, plan = plan_of(settings, policy="wfq")
    keys = Keys(s.key_prefix)
    now = redis_now_ms(r)
    push(r, s, "normal", "n0", enq_ms=now)
    urgent(r, s, "batch", "b-urgent", now)
    assert order(r, plan, 1) == ["batch:b-urgent"]
    fair = {k.decode(): v.decode() for k, v in r.hgetall(keys.fair("default")).items()}
    assert float(fair["f:batch"]) > 0
    assert float(fair.get("v", 0)) == 0
