"""pick.lua's lifecycle additions, against a real Redis: a stale candidate (past its
tier's queue TTL) is dispatched at once without taking tokens; priority inheritance
(lua/lifecycle/boost.lua) dispatches a boosted lower-tier task first, charged to its own tenant
and tier; deadline boost (lua/dispatch/deadline.lua) promotes an urgent task inside its tier."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.dispatch.deadline import DeadlineCall
from gateway_tasks.lifecycle.inherit import BoostCall
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.dispatch.release import REQUEUE, ReleaseCall
from gateway_tasks.dispatch.router import PickPlan, Picked, Wait, pick_now

BIG = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",), tpm=10**9, rpm=10**9)


def push(r, s: Settings, tier: str, tenant: str, *, est: int = 100, enq_ms: int | None = None) -> tuple[str, str]:
    """Queue a minimal kombu envelope through enqueue.lua; (tag, index entry)."""
    tag = uuid.uuid4().hex
    msg = {"body": "", "headers": {"gt_est_tokens": est, "gt_tenant": tenant, "id": tag},
           "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "q"}}}
    done = enqueue(r, EnqueueCall(Keys(s.key_prefix), s.tier(tier), "default", tenant, tag, est,
                                  json.dumps(msg), enqueued_ms=enq_ms))
    assert done.accepted and done.entry
    return tag, done.entry


def plan_for(settings: Settings, pools=(BIG,), **changes) -> tuple[Settings, PickPlan]:
    s = settings.with_(policy="wfq", pools=tuple(pools), **changes)
    return s, PickPlan(s, s.queue_names())


def pick(r, plan: PickPlan):
    return pick_now(scripts_for(r), plan)


def test_a_stale_candidate_takes_no_tokens(r, settings):
    small = replace(BIG, tpm=6_000, rpm=10_000)          # 6000-token bucket
    s, plan = plan_for(settings, pools=(small,))
    keys = Keys(s.key_prefix)
    old = redis_now_ms(r) - 20_000                        # 20 s ago: past VIP's 15 s TTL
    stale, _ = push(r, s, "vip", "acme", est=5_000, enq_ms=old)
    fresh, _ = push(r, s, "vip", "acme", est=5_000)
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.tag == stale and got.est_tokens == 0
    tokens = float(r.hget(keys.bucket("default"), "tokens"))
    assert tokens > 5_900                                 # nothing taken
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.tag == fresh
    assert float(r.hget(keys.bucket("default"), "tokens")) < 1_100


def test_stale_check_is_off_with_a_zero_ttl(r, settings):
    tiers = tuple(replace(t, queue_ttl_s=0.0) for t in settings.tiers)
    s, plan = plan_for(settings, tiers=tiers)
    push(r, s, "vip", "acme", est=700, enq_ms=redis_now_ms(r) - 60_000)
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.est_tokens == 700


def test_an_inherited_task_goes_first_charged_to_its_own_tier(r, settings):
    s, plan = plan_for(settings)
    keys = Keys(s.key_prefix)
    for i in range(5):
        push(r, s, "vip", "acme")
        push(r, s, "batch", "bulk")
    wanted, entry = push(r, s, "batch", "bulk")           # the newest batch task
    scripts_for(r).run(BoostCall(keys, "default", "batch", "vip", entry))
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.tag == wanted and got.tier == "batch"
    assert int(r.hget(keys.inflight("default"), "bulk")) == 1
    record = r.hget(keys.dispatched("default"), wanted).decode()
    assert record.startswith("batch|")                    # a requeue puts it back in batch
    scripts_for(r).run(ReleaseCall(keys, s, "default", wanted, REQUEUE))   # e.g. a 429
    assert r.zscore(keys.index("default", "batch"), entry) is not None
    again = pick(r, plan)                                 # still boosted while it is queued
    assert isinstance(again, Picked) and again.tag == wanted
    scripts_for(r).run(ReleaseCall(keys, s, "default", wanted))            # done
    assert pick(r, plan).tier == "vip"                    # the line goes: fair order again
    assert r.hget(keys.fair("default"), "b:batch") is None


def test_a_stale_boost_line_is_dropped(r, settings):
    s, plan = plan_for(settings)
    keys = Keys(s.key_prefix)
    push(r, s, "vip", "acme")
    scripts_for(r).run(BoostCall(keys, "default", "batch", "vip", "gone|0000000000000001|x|1|1|1"))
    assert pick(r, plan).tier == "vip"
    assert r.hget(keys.fair("default"), "b:batch") is None


def test_an_urgent_task_is_promoted_inside_its_tier(r, settings):
    s, plan = plan_for(settings)
    keys = Keys(s.key_prefix)
    now = redis_now_ms(r)
    push(r, s, "normal", "early", enq_ms=now - 5)            # first in fair order
    later_tag, later_entry = push(r, s, "normal", "late", enq_ms=now)
    push(r, s, "normal", "late", enq_ms=now)
    push(r, s, "normal", "late", enq_ms=now)
    urgent_tag, urgent_entry = push(r, s, "normal", "late", enq_ms=now)   # last of late's four
    scripts_for(r).run(DeadlineCall(keys, "default", "normal", now + 600_000, later_entry))  # not due yet
    scripts_for(r).run(DeadlineCall(keys, "default", "normal", now - 1, urgent_entry))       # due
    first = pick(r, plan)
    assert isinstance(first, Picked) and first.tag == urgent_tag
    second = pick(r, plan)
    assert second.tenant == "early"                            # then fair order as before
    # the used line was dropped (lazily, by the pick after it); the one not due yet stays
    lines = r.hget(keys.fair("default"), "d:normal").decode().split("\n")
    assert len(lines) == 1 and lines[0].endswith(later_entry)
    assert int(r.hget(keys.fair("default"), "dn:normal")) == now + 600_000
    assert isinstance(pick(r, plan), Picked) and not isinstance(pick(r, plan), Wait)
