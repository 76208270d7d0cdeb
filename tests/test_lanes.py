"""Lanes inside a tier (gateway_tasks/dispatch/lanes.py): interactive work goes before scheduled
work (cron runs) by a bounded lag.  The pure encoding table-tested, then the real scripts
against a real Redis: an interactive tenant goes ahead of scheduled tenants that came
earlier, a scheduled run goes after at most the lag of interactive service, a lone
scheduled tenant is served at once, a tenant's own interactive request overtakes its
queued crons, a lag of 0 is exactly the one-lane order, and the lane survives a requeue,
a lease restore, a cancel, an eviction and a move to a backup pool."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

import pytest

from gateway_tasks.lifecycle.cancel import CancelCall, TaskRef
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.core.errors import InvalidRequest
from gateway_tasks.dispatch.evict import EvictCall
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.lanes import INTERACTIVE, SCHEDULED, active_score, lane_for, marks_scheduled, start_tag
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.dispatch.release import REQUEUE, ReleaseCall
from gateway_tasks.dispatch.router import PickPlan, Picked, pick_now

BIG = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",), tpm=10**9, rpm=10**9)
LAG = 1000
EST = 100


# -- the encoding, pure -----------------------------------------------------------------

@pytest.mark.parametrize("source,lane,expected", [
    ("api", None, INTERACTIVE), ("api-sync", None, INTERACTIVE), ("bench", None, INTERACTIVE),
    ("cron", None, SCHEDULED), ("api", SCHEDULED, SCHEDULED), ("cron", INTERACTIVE, INTERACTIVE),
])
def test_a_submits_lane(source, lane, expected):
    assert lane_for(source, lane) == expected


def test_an_unknown_lane_is_refused():
    with pytest.raises(InvalidRequest, match="lane must be one of"):
        lane_for("api", "urgent")


@pytest.mark.parametrize("start,scheduled,lag,score", [
    (0, False, 8192, 0), (0, True, 8192, 16385), (100, False, 8192, 200), (100, True, 8192, 16585),
    (100, True, 0, 200),             # no lanes: a scheduled head scores as an interactive one
    (7, True, 1, 17),
])
def test_active_scores_carry_the_lag_and_give_the_real_tag_back(start, scheduled, lag, score):
    assert active_score(start, scheduled, lag) == score
    assert start_tag(score, lag) == start
    assert marks_scheduled(SCHEDULED if scheduled else INTERACTIVE, lag) == (scheduled and lag > 0)


def test_a_scheduled_head_orders_after_interactive_ones_up_to_the_lag():
    # interactive at tag t goes before scheduled at tag s while t <= s + lag (ties: interactive)
    assert active_score(1100, False, 1000) < active_score(100, True, 1000)
    assert active_score(1101, False, 1000) > active_score(100, True, 1000)


@pytest.mark.parametrize("lane", [INTERACTIVE, SCHEDULED])
def test_index_entries_keep_their_lane(lane):
    entry = IndexEntry("acme", 0x2A, "tag1", 120, 1_700_000_000_000, 1.5, lane)
    text = entry.encode()
    assert text.split("|")[1] == ("s" if lane == SCHEDULED else "") + "000000000000002a"
    assert IndexEntry.decode(text) == entry
    assert IndexEntry.decode(text.encode()) == entry


def test_an_index_entry_carries_its_messages_size_and_reads_one_without_it():
    entry = IndexEntry("acme", 7, "tag1", 120, 1_700_000_000_000, 1.0, INTERACTIVE, 2432)
    assert entry.encode().endswith("|1|2432") and IndexEntry.decode(entry.encode()) == entry
    old = "acme|0000000000000007|tag1|120|1700000000000|1"
    assert IndexEntry.decode(old) == replace(entry, message_b=None)
    with pytest.raises(ValueError, match="6 or 7 fields"):
        IndexEntry.decode(old + "|2432|9")


def test_a_tenants_interactive_entries_sort_before_its_scheduled_ones():
    entries = [IndexEntry("acme", seq, f"t{seq}", 1, 1, 1.0, lane)
               for seq, lane in ((1, SCHEDULED), (2, INTERACTIVE), (3, SCHEDULED), (0xfff, INTERACTIVE))]
    ordered = sorted(e.encode() for e in entries)
    assert [IndexEntry.decode(e).seq for e in ordered] == [2, 0xfff, 1, 3]


# -- the scripts, real Redis ----------------------------------------------------------------

def lane_settings(settings: Settings, lag: int = LAG) -> Settings:
    tiers = tuple(replace(t, scheduled_lag_tokens=lag, queue_ttl_s=0.0) for t in settings.tiers)
    return settings.with_(policy="wfq", pools=(BIG,), tiers=tiers)


def plan_of(s: Settings) -> PickPlan:
    return PickPlan(s, s.queue_names())


def push(r, s: Settings, tenant: str, lane: str = INTERACTIVE, *, tier: str = "normal", est: int = EST,
         weight: float = 1.0) -> tuple[str, str]:
    """Queue a minimal kombu envelope through enqueue.lua; (tag, index entry)."""
    tag = uuid.uuid4().hex
    msg = {"body": "", "headers": {"gt_est_tokens": est, "gt_tenant": tenant, "id": tag},
           "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "q"}}}
    done = enqueue(r, EnqueueCall(Keys(s.key_prefix), s.tier(tier), "default", tenant, tag, est,
                                  json.dumps(msg), tenant_weight=weight, lane=lane))
    assert done.accepted and done.entry
    return tag, done.entry


def served(r, plan: PickPlan, n: int, ack: bool = True) -> list[Picked]:
    """The next n dispatches, each acked at once (caps never bind) unless ack=False."""
    out = []
    for _ in range(n):
        got = pick_now(scripts_for(r), plan)
        assert isinstance(got, Picked), got
        if ack:
            assert scripts_for(r).run(ReleaseCall(plan.keys, plan.settings, got.pool, got.tag)).released
        out.append(got)
    return out


def score_of(r, s: Settings, tenant: str, tier: str = "normal") -> int | None:
    raw = r.zscore(Keys(s.key_prefix).active("default", tier), tenant)
    return None if raw is None else int(raw)


def test_an_interactive_tenant_goes_before_scheduled_tenants_that_came_earlier(r, settings):
    s = lane_settings(settings)
    plan = plan_of(s)
    for i in range(5):
        push(r, s, f"cron{i}", SCHEDULED)
    probe, _ = push(r, s, "probe")
    got = served(r, plan, 6)
    assert got[0].tag == probe
    assert sorted(p.tenant for p in got[1:]) == [f"cron{i}" for i in range(5)]
    assert r.zcard(Keys(s.key_prefix).index("default", "normal")) == 0


def test_a_scheduled_head_is_scored_at_its_tag_plus_the_lag(r, settings):
    s = lane_settings(settings)
    _, entry = push(r, s, "cron", SCHEDULED)
    assert entry.split("|")[1].startswith("s")
    assert score_of(r, s, "cron") == active_score(0, True, LAG)
    _, entry = push(r, s, "user")
    assert not entry.split("|")[1].startswith("s")
    assert score_of(r, s, "user") == active_score(0, False, LAG)


@pytest.mark.parametrize("weight", [1.0, 2.0])
def test_a_scheduled_run_waits_for_at_most_the_lag_of_interactive_service(r, settings, weight):
    # both arrive at virtual time 0: the interactive flood is served while its start tag is at
    # most 0 + LAG (its tags advance EST / weight a task), then the cron run goes
    s = lane_settings(settings)
    plan = plan_of(s)
    for _ in range(60):
        push(r, s, "flood", weight=weight)
    cron, _ = push(r, s, "cron", SCHEDULED)
    ahead = int(LAG * weight) // EST + 1          # the flood's start tags 0, EST / weight, ..., LAG
    order = [p.tag for p in served(r, plan, ahead + 1)]
    assert order.index(cron) == ahead
    # the cron run's own start tag was 0: the tier's virtual time stays where the flood took it
    assert int(r.hget(Keys(s.key_prefix).fair("default"), "tv:normal")) == LAG


def test_the_lag_does_not_starve_a_tenant_with_a_cron_backlog(r, settings):
    # a tenant with many scheduled runs against a steady interactive tenant: it is served
    # once per LAG + EST of the interactive tenant's service, never shut out
    s = lane_settings(settings)
    plan = plan_of(s)
    for _ in range(200):
        push(r, s, "user")
    for _ in range(20):
        push(r, s, "cron", SCHEDULED)
    tenants = [p.tenant for p in served(r, plan, 120)]
    gaps = [i for i, t in enumerate(tenants) if t == "cron"]
    assert len(gaps) >= 5
    # after the first (LAG / EST + 1 interactive ahead) the two share fairly: once the cron
    # tenant is LAG behind, its runs come one per interactive task
    assert gaps[0] == LAG // EST + 1
    assert max(b - a for a, b in zip(gaps, gaps[1:])) <= 2


def test_a_lone_scheduled_tenant_is_served_at_once(r, settings):
    s = lane_settings(settings, lag=10**6)
    plan = plan_of(s)
    tags = [push(r, s, "cron", SCHEDULED)[0] for _ in range(3)]
    assert [p.tag for p in served(r, plan, 3)] == tags      # no waiting for time: work-conserving


def test_a_tenants_own_interactive_request_overtakes_its_queued_crons(r, settings):
    s = lane_settings(settings)
    plan = plan_of(s)
    crons = [push(r, s, "acme", SCHEDULED)[0] for _ in range(3)]
    push(r, s, "other", SCHEDULED)
    assert score_of(r, s, "acme") % 2 == 1
    mine, _ = push(r, s, "acme")                            # its head now: its place is interactive
    assert score_of(r, s, "acme") == active_score(0, False, LAG)
    got = served(r, plan, 5)
    assert got[0].tag == mine
    assert [p.tag for p in got if p.tenant == "acme"][1:] == crons   # the crons in their order


def test_a_lag_of_zero_is_exactly_the_one_lane_order(r, settings, key_prefix):
    # the same arrivals, lanes given, with lag 0 and with everything interactive: same order
    def run(prefix: str, lag: int, lanes: bool) -> list[tuple[str, int]]:
        s = replace(lane_settings(settings, lag), key_prefix=prefix)
        plan = plan_of(s)
        for i in range(30):
            tenant = f"t{i % 7}"
            lane = SCHEDULED if lanes and i % 3 else INTERACTIVE
            push(r, s, tenant, lane, est=50 + 10 * (i % 5), weight=1 + i % 2)
        out = [(p.tenant, p.est_tokens) for p in served(r, plan, 30)]
        assert score_of(r, s, "t0") is None
        return out

    one_lane = run(key_prefix + "a:", 0, lanes=False)
    assert run(key_prefix + "b:", 0, lanes=True) == one_lane
    assert run(key_prefix + "c:", LAG, lanes=True) != one_lane     # (the lanes do reorder it)


def test_no_lane_is_marked_with_a_lag_of_zero(r, settings):
    s = lane_settings(settings, lag=0)
    _, entry = push(r, s, "cron", SCHEDULED)
    assert IndexEntry.decode(entry).lane == INTERACTIVE and score_of(r, s, "cron") == 0


def test_a_scheduled_run_taken_out_of_fair_order_is_charged_from_its_real_start_tag(r, settings):
    # deadline boost dispatches a tenant's second cron run first: its start tag is read back
    # from a score that carries the lag, and its next run is in line at the real finish tag
    from gateway_tasks.core.clock import redis_now_ms
    from gateway_tasks.dispatch.deadline import DeadlineCall

    s = lane_settings(settings)
    plan = plan_of(s)
    keys = Keys(s.key_prefix)
    push(r, s, "cron", SCHEDULED)
    urgent, entry = push(r, s, "cron", SCHEDULED)
    push(r, s, "cron", SCHEDULED)
    scripts_for(r).run(DeadlineCall(keys, "default", "normal", redis_now_ms(r) - 1, entry))
    (got,) = served(r, plan, 1)
    assert got.tag == urgent
    assert score_of(r, s, "cron") == active_score(EST, True, LAG)


def test_a_requeued_scheduled_run_keeps_its_lane(r, settings):
    s = lane_settings(settings)
    plan = plan_of(s)
    keys = Keys(s.key_prefix)
    cron, entry = push(r, s, "cron", SCHEDULED)
    push(r, s, "cron", SCHEDULED)
    (first,) = served(r, plan, 1, ack=False)
    assert first.tag == cron
    assert scripts_for(r).run(ReleaseCall(keys, s, "default", cron, REQUEUE)).released   # a 429
    assert r.zscore(keys.index("default", "normal"), entry) is not None     # the same entry: marked
    user, _ = push(r, s, "user")
    got = served(r, plan, 2)
    assert [p.tag for p in got] == [user, cron]


def test_an_interactive_task_put_back_ahead_of_scheduled_ones_makes_its_tenant_interactive(r, settings):
    s = lane_settings(settings)
    plan = plan_of(s)
    keys = Keys(s.key_prefix)
    mine, _ = push(r, s, "acme")
    push(r, s, "acme", SCHEDULED)
    (got,) = served(r, plan, 1, ack=False)
    assert got.tag == mine and score_of(r, s, "acme") % 2 == 1     # in line by its cron now
    rival, _ = push(r, s, "rival")
    assert scripts_for(r).run(ReleaseCall(keys, s, "default", mine, REQUEUE)).released
    assert score_of(r, s, "acme") % 2 == 0                          # its head is interactive again
    assert [p.tag for p in served(r, plan, 2)] == [rival, mine]     # fair order between the two


def test_a_restored_scheduled_run_keeps_its_lane(r, settings):
    from gateway_tasks.dispatch.leases import sweep_expired

    s = lane_settings(settings)
    plan = plan_of(s)
    keys = Keys(s.key_prefix)
    cron, _ = push(r, s, "cron", SCHEDULED)
    served(r, plan, 1, ack=False)
    r.zadd(keys.dispatched_at("default"), {cron: 1.0})              # its holder died long ago
    assert sweep_expired(r, scripts_for(r), keys, s) == 1
    assert score_of(r, s, "cron") == active_score(EST, True, LAG)    # back in line at its finish tag
    user, _ = push(r, s, "user")
    assert [p.tag for p in served(r, plan, 2)] == [user, cron]


def test_cancelling_a_tenants_last_interactive_task_puts_it_in_the_scheduled_lane(r, settings):
    s = lane_settings(settings)
    plan = plan_of(s)
    keys = Keys(s.key_prefix)
    mine, entry = push(r, s, "acme")
    push(r, s, "acme", SCHEDULED)
    late, _ = push(r, s, "late")          # after acme, same virtual time: acme would go first
    ref = TaskRef("default", "normal", "acme", mine, entry)
    assert scripts_for(r).run(CancelCall(keys, "task-1", ref, entry, LAG)) == "queued"
    assert score_of(r, s, "acme") == active_score(0, True, LAG)
    assert [p.tenant for p in served(r, plan, 2)] == ["late", "acme"]


def test_an_eviction_takes_the_newest_task_whatever_its_lane(r, settings):
    # b1's line: its newest task (interactive) sorts before its older cron run, so its last
    # entry by bytes is not its newest: the interactive one is read too
    s = lane_settings(settings)
    keys = Keys(s.key_prefix)
    push(r, s, "b1", SCHEDULED, tier="batch")
    push(r, s, "b2", tier="batch")
    push(r, s, "b2", tier="batch")
    newest, _ = push(r, s, "b1", tier="batch")
    victim = scripts_for(r).run(EvictCall(keys, "default", ("batch",), (LAG,)))
    assert victim is not None and victim.tag == newest
    cron_run = IndexEntry.decode(r.zrange(keys.index("default", "batch"), 0, 0)[0])
    assert cron_run.tenant == "b1" and cron_run.lane == SCHEDULED


def test_evicting_a_tenants_last_interactive_task_puts_it_in_the_scheduled_lane(r, settings):
    s = lane_settings(settings)
    keys = Keys(s.key_prefix)
    push(r, s, "b1", SCHEDULED, tier="batch")
    newest, _ = push(r, s, "b1", tier="batch")        # the newest task of the tier, b1's head
    victim = scripts_for(r).run(EvictCall(keys, "default", ("batch",), (LAG,)))
    assert victim is not None and victim.tag == newest
    assert score_of(r, s, "b1", "batch") == active_score(0, True, LAG)


def test_a_task_moved_to_a_backup_pool_keeps_its_lane(r, settings):
    from gateway_tasks.upstream.rescue import Rescuer, WithdrawCall

    s = lane_settings(settings)
    s = s.with_(pools=(BIG, replace(BIG, name="backup", models=("m2",))))
    keys = Keys(s.key_prefix)
    push(r, s, "acme", SCHEDULED, tier="vip")
    (record,) = scripts_for(r).run(WithdrawCall(keys, "default", "vip", 10))
    rescuer = Rescuer(r, s)
    assert rescuer._enqueue(s.tier("vip"), "backup", IndexEntry.decode(record["entry"]),
                            json.loads(record["message"]))
    (moved,) = r.zrange(keys.index("backup", "vip"), 0, -1)
    assert IndexEntry.decode(moved).lane == SCHEDULED
    assert int(r.zscore(keys.active("backup", "vip"), "acme")) % 2 == 1


# -- the producer ----------------------------------------------------------------------

@pytest.fixture
def gw(make_gateway, settings):
    return make_gateway([("acme", "vip")], settings=lane_settings(settings))


def test_a_cron_submit_is_scheduled_and_an_api_one_interactive(gw):
    keys = Keys(gw.settings.key_prefix)
    cron = gw.submit("acme", "nightly", max_tokens=5, source="cron", count_quota=False)
    background = gw.submit("acme", "later", max_tokens=5, lane="scheduled")
    user = gw.submit("acme", "now", max_tokens=5)
    assert (cron.lane, background.lane, user.lane) == (SCHEDULED, SCHEDULED, INTERACTIVE)
    entries = [IndexEntry.decode(e) for e in gw.r.zrange(keys.index("default", "vip"), 0, -1)]
    # the tenant's line: its interactive request first, then its scheduled ones in order
    assert [e.lane for e in entries] == [INTERACTIVE, SCHEDULED, SCHEDULED]
    assert [e.seq for e in entries[1:]] == sorted(e.seq for e in entries[1:])
    with pytest.raises(InvalidRequest, match="lane"):
        gw.submit("acme", "x", max_tokens=5, lane="fast")


def test_the_rest_api_takes_a_lane(gw):
    from fastapi.testclient import TestClient

    from gateway_tasks.rest.app import create_app

    key = gw.register_tenant("acme", "vip")
    with TestClient(create_app(gw)) as client:
        auth = {"Authorization": f"Bearer {key}"}
        got = client.post("/v1/tasks", json={"messages": "later", "max_tokens": 5, "lane": "scheduled"},
                          headers=auth)
        assert got.status_code == 202 and got.json()["lane"] == "scheduled"
        assert client.post("/v1/tasks", json={"messages": "now", "max_tokens": 5},
                           headers=auth).json()["lane"] == "interactive"
        assert client.post("/v1/tasks", json={"messages": "x", "lane": "fast"}, headers=auth).status_code == 400
        schema = client.get("/openapi.json").json()["components"]["schemas"]["TaskRequest"]
        assert "lane" in schema["properties"]


def test_the_vip_reserve_is_for_interactive_vip_work_not_vip_cron_runs(r, settings):
    """VIP cron runs (scheduled lane) leave the reserve to interactive VIP requests, as the
    other tiers do: a storm of VIP crons cannot take the head-room a VIP user finds."""
    small = replace(BIG, tpm=1_000, rpm=10_000)   # capacity 1000 tokens, vip reserves 20% = 200
    s = lane_settings(settings).with_(pools=(small,))
    plan = plan_of(s)
    early, _ = push(r, s, "early-user", tier="vip", est=10)    # interactive vip work seen lately:
    assert served(r, plan, 1)[0].tag == early                   # the reserve is held (1000 -> 990)
    push(r, s, "cron-a", SCHEDULED, tier="vip", est=450)
    push(r, s, "cron-b", SCHEDULED, tier="vip", est=450)
    assert served(r, plan, 1)[0].tenant == "cron-a"            # 990 -> 540
    got = pick_now(scripts_for(r), plan)
    assert not isinstance(got, Picked) and got.wait_ms > 0      # 540 - 450 < the 200 reserve
    user, _ = push(r, s, "user", tier="vip", est=500)           # interactive: may use the reserve
    assert served(r, plan, 1)[0].tag == user
    # with no lanes (D = 0) nothing is marked scheduled: vip crons use the reserve as before
    flat = lane_settings(settings, lag=0).with_(pools=(small,), key_prefix=s.key_prefix + "flat:")
    push(r, flat, "cron-c", SCHEDULED, tier="vip", est=450)
    push(r, flat, "cron-d", SCHEDULED, tier="vip", est=450)
    assert [p.tenant for p in served(r, plan_of(flat), 2)] == ["cron-c", "cron-d"]
