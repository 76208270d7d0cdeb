"""Worker slots kept for reserved tiers' interactive work (Settings.reserved_worker_slots):
the split of a dispatcher's free slots (pure), pick.lua honouring it against a real Redis,
and a real worker whose kept slot takes a vip request while batch work fills the others."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

import pytest

from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.lanes import INTERACTIVE, SCHEDULED
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool, Settings, load_settings
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.dispatch.release import ReleaseCall
from gateway_tasks.dispatch.poll_step import next_step
from gateway_tasks.dispatch.router import NO_LIMIT, PickPlan, Picked, Wait, general_picks, kept_slots

BIG = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",), tpm=10**9, rpm=10**9)


@pytest.mark.parametrize("setting, prefetch, serves_reserved, kept", [
    (1, 16, True, 1), (3, 16, True, 3),
    (1, 16, False, 0),          # no reserved tier consumed: nothing to keep slots for
    (4, 4, True, 3),            # always one slot for everything else
    (1, 1, True, 0), (1, 0, True, 0), (1, None, True, 0),   # one slot, or no prefetch limit
    (0, 16, True, 0),           # off
])
def test_kept_slots(setting, prefetch, serves_reserved, kept):
    assert kept_slots(setting, prefetch, serves_reserved) == kept


@pytest.mark.parametrize("free, kept, general", [(8, 0, NO_LIMIT), (8, 1, 7), (1, 1, 0), (2, 3, 0)])
def test_general_picks(free, kept, general):
    assert general_picks(free, kept) == general


@pytest.mark.parametrize("mode, slot_limited, general_now, step", [
    ("wait", True, 1, "pick"),          # a slot of its own freed since the pick
    ("wait", True, NO_LIMIT, "pick"),
    ("wait", True, 0, "wait"),          # still only kept slots: wait for a bell
    ("wait", False, 0, "wait"),         # waiting for tokens or work: as it was
    ("pick", True, 0, "pick"),          # woken (its own bell, the reserved bell): pick
    ("pick", False, 3, "pick"),
])
def test_next_step(mode, slot_limited, general_now, step):
    assert next_step(mode, slot_limited, general_now) == step


def test_the_setting_fails_fast_when_negative():
    with pytest.raises(ConfigError, match="reserved_worker_slots"):
        load_settings(env={"GATEWAY_RESERVED_WORKER_SLOTS": "-1"})
    assert load_settings(env={"GATEWAY_RESERVED_WORKER_SLOTS": "2"}).reserved_worker_slots == 2


def push(r, s: Settings, tier: str, lane: str = INTERACTIVE) -> str:
    tag = uuid.uuid4().hex
    tenant = f"{tier}-{tag[:6]}"
    msg = {"body": "", "headers": {"gt_est_tokens": 100, "gt_tenant": tenant, "id": tag},
           "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "q"}}}
    assert enqueue(r, EnqueueCall(Keys(s.key_prefix), s.tier(tier), "default", tenant, tag, 100,
                                  json.dumps(msg), lane=lane)).accepted
    return tag


def test_pick_takes_only_reserved_interactive_work_into_kept_slots(r, settings):
    tiers = tuple(replace(t, queue_ttl_s=0.0) for t in settings.tiers)   # lanes on (default lag)
    s = settings.with_(policy="wfq", pools=(BIG,), tiers=tiers)
    assert s.tier("vip").scheduled_lag_tokens > 0
    plan = PickPlan(s, s.queue_names())
    assert plan.serves_reserved
    for _ in range(3):
        push(r, s, "batch")
        push(r, s, "normal")
    cron = push(r, s, "vip", SCHEDULED)          # a vip cron run may not use the reserve either
    user = push(r, s, "vip")
    scripts = scripts_for(r)
    got = scripts.run(plan.batch(3, general=0))  # only the kept slots are free
    assert [p.tag for p in got] == [user]
    assert scripts.run(plan.batch(3, general=0)) == Wait(-1)   # the rest waits for a general slot
    got = scripts.run(plan.batch(4, general=2))  # two general slots, two kept
    assert len(got) == 2 and all(isinstance(p, Picked) for p in got)
    more = scripts.run(plan.batch(8))            # no limit: everything else, the cron run included
    assert len(more) == 5 and cron in {p.tag for p in more}


@pytest.mark.slow
@pytest.mark.parametrize("reserved", [1, 0])
def test_a_vip_request_takes_a_kept_slot_while_batch_work_fills_the_others(settings, r, tmp_path, reserved):
    with SimulatorThread(SimConfig(tpm=10**7, rpm=10**6, base_latency_ms=2_000)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",),
                    tpm=10**7, rpm=10**6)
        s = settings.with_(pools=(pool,), reserved_worker_slots=reserved)
        keys = Keys(s.key_prefix)
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        for i in range(4):
            gw.register_tenant(f"bulk{i}", "batch")
        worker = processes.worker(s, concurrency=3, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            batch = [gw.submit(f"bulk{i}", f"document {i}", max_tokens=5) for i in range(4)]
            deadline = time.monotonic() + 30
            while r.hlen(keys.dispatched("default")) < 3 - reserved and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)       # the worker took what it may, and waits
            assert r.hlen(keys.dispatched("default")) == 3 - reserved
            vip = gw.submit("acme", "a user's question", max_tokens=5).get(timeout=60)
            done = [h.get(timeout=60) for h in batch]
        finally:
            worker.stop()
    first_batch_done = min(d["timing"]["completed_ms"] for d in done)
    if reserved:   # the kept slot took it at once, while every other slot still ran batch work
        assert vip["timing"]["dispatched_ms"] < first_batch_done
    else:          # all three slots ran batch work: the vip request waited for one to end
        assert vip["timing"]["dispatched_ms"] >= first_batch_done


def test_a_release_rings_its_dispatchers_own_bell_once(r, settings):
    s = settings.with_(policy="wfq", pools=(BIG,))
    plan = PickPlan(s, s.queue_names())
    keys = Keys(s.key_prefix)
    own = keys.dispatcher_bell("default", "d1")
    for _ in range(3):
        push(r, s, "batch")
    scripts = scripts_for(r)
    first, second, third = scripts.run(plan.batch(3))
    assert scripts.run(ReleaseCall(keys, s, "default", first.tag)).released
    assert not r.exists(own)                       # not slot-limited: no bell named, none rung
    assert scripts.run(ReleaseCall(keys, s, "default", second.tag, wake=own)).released
    assert r.llen(own) == 1 and 0 < r.pttl(own) <= 10_000
    assert scripts.run(ReleaseCall(keys, s, "default", third.tag, wake=own)).released
    assert r.llen(own) == 1                        # one wake-up is enough
    assert r.hlen(keys.dispatched("default")) == 0


def test_a_kept_slot_serves_vip_only_within_its_reservation(r, settings):
    """Under wfq a vip task goes around a winner waiting for a general slot only while vip is
    at most the reserve's worth of tokens ahead of its fair share (as it goes around one
    waiting for tokens): the kept slots do not move the 70:20:10 shares."""
    tiers = tuple(replace(t, queue_ttl_s=0.0) for t in settings.tiers)
    s = settings.with_(policy="wfq", pools=(BIG,), tiers=tiers)
    plan = PickPlan(s, s.queue_names())
    keys = Keys(s.key_prefix)
    push(r, s, "batch")
    user = push(r, s, "vip")
    # vip far ahead of its share: its finish tag well past the pool's virtual time
    r.hset(keys.fair("default"), mapping={"v": 1000, "f:vip": 1000 + 10**12})
    scripts = scripts_for(r)
    assert scripts.run(plan.batch(1, general=0)) == Wait(-1)      # batch wins, and needs a slot
    got = scripts.run(plan.batch(2))
    assert [p.queue for p in got] == ["gt.batch.default", "gt.vip.default"] and got[1].tag == user
    push(r, s, "batch")
    user = push(r, s, "vip")
    r.hset(keys.fair("default"), mapping={"f:vip": 0})                  # vip behind its share
    got = scripts.run(plan.batch(1, general=0))
    assert [p.tag for p in got] == [user]


def test_only_reserved_interactive_arrivals_ring_the_reserved_bell_and_keep_one_token(r, settings):
    s = settings.with_(policy="wfq", pools=(BIG,))
    keys = Keys(s.key_prefix)
    reserved = keys.reserved_bell("default")
    rung = lambda: {t: r.llen(keys.tier_bell("default", t)) for t in ("vip", "normal", "batch")}  # noqa: E731
    push(r, s, "batch")
    push(r, s, "normal")
    push(r, s, "vip", SCHEDULED)               # a vip cron run does not use the reserve
    assert rung() == {"vip": 1, "normal": 1, "batch": 1} and not r.exists(reserved)
    push(r, s, "vip")
    push(r, s, "vip")
    assert rung()["vip"] == 3 and r.llen(reserved) == 1   # one wake-up is kept, not one per arrival
    assert not r.exists(keys.bell("default"))  # arrivals ring their tier's bell, not the pool's
