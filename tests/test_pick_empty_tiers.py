"""pick.lua's empty-tier flag and its head+next read, against a real Redis.

A pick that finds a tier's active set empty flags the tier ('e:<tier>' in the pool's
fair hash: until when) and reads the set no more until a tenant joins it: gt_activate
(enqueue, an unparking or put-back release) is the one way in, and clears the flag.
The flag holds for a second at most (a tenant let in without clearing it, by a producer
of an earlier release, is found then).  The pick that flags a tier also empties its
bell (tokens rung for work that is gone).
A flag left set with a tenant in line would stall the tier, so besides the paths
one by one, a random mix of enqueues, picks, acks, put-backs and cancels checks
after every step that a pick finding nothing means nothing could be dispatched,
and that draining at the end dispatches every task left exactly once.
"""

from __future__ import annotations

import random
from collections import Counter

from gateway_tasks.lifecycle.cancel import CancelCall, TaskRef, find_entry
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import default_tiers
from tests.test_router import make, pick, push
from gateway_tasks.dispatch.release import ReleaseCall
from gateway_tasks.dispatch.router import Picked, Wait

TIERS = ("vip", "normal", "batch")


def flags(r, s) -> dict[str, str | None]:
    """Each tier's empty flag: None (never written), "set" (pick.lua skips the tier until
    the time it holds, a second from the pick that found it empty) or "clear"."""
    fair = Keys(s.key_prefix).fair("default")
    got = r.hmget(fair, [f"e:{t}" for t in TIERS])
    now = redis_now_ms(r)
    out: dict[str, str | None] = {}
    for t, v in zip(TIERS, got):
        if v is None:
            out[t] = None
        else:
            until = float(v)
            assert until == 0 or now < until <= now + 1_000
            out[t] = "set" if until > now else "clear"
    return out


def capped(cap: int):
    return tuple(t.__class__(**{**t.__dict__, "max_concurrency_per_tenant": cap}) for t in default_tiers())


def release(r, s, tag: str, mode: str = "ack"):
    return scripts_for(r).run(ReleaseCall(Keys(s.key_prefix), s, "default", tag, mode))


def test_a_tier_found_empty_is_flagged_and_an_arrival_clears_the_flag(r, settings):
    s, plan = make(settings, "wfq")
    assert flags(r, s) == dict.fromkeys(TIERS)           # never read: no flag
    assert pick(r, plan) == Wait(-1)
    assert flags(r, s) == dict.fromkeys(TIERS, "set")
    tag = push(r, s, "normal", tenant="acme")
    assert flags(r, s) == {"vip": "set", "normal": "clear", "batch": "set"}
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.tag == tag
    assert pick(r, plan) == Wait(-1)
    assert flags(r, s)["normal"] == "set"


def test_a_task_put_back_into_a_tier_found_empty_is_dispatched_again(r, settings):
    s, plan = make(settings, "wfq")
    tag = push(r, s, "batch", tenant="acme")
    assert pick(r, plan).tag == tag
    assert pick(r, plan) == Wait(-1)
    assert flags(r, s)["batch"] == "set"
    assert release(r, s, tag, "requeue").released
    assert flags(r, s)["batch"] == "clear"
    assert pick(r, plan).tag == tag


def test_a_tenant_unparked_into_a_tier_found_empty_is_dispatched(r, settings):
    s, plan = make(settings, "wfq", tiers=capped(1))
    first = push(r, s, "normal", tenant="acme")
    second = push(r, s, "normal", tenant="acme")
    assert pick(r, plan).tag == first                    # acme at its cap of 1: parked
    assert pick(r, plan) == Wait(-1)
    assert flags(r, s)["normal"] == "set"
    assert release(r, s, first).released                 # the ack unparks acme
    assert flags(r, s)["normal"] == "clear"
    assert pick(r, plan).tag == second


def test_a_batch_that_empties_a_tier_flags_it_in_the_same_call(r, settings):
    s, plan = make(settings, "wfq")
    tags = {push(r, s, "vip", tenant=f"t{i}") for i in range(2)}
    got = scripts_for(r).run(plan.batch(4))
    assert {p.tag for p in got} == tags
    assert flags(r, s)["vip"] == "set"


def test_a_tier_found_empty_has_its_bells_stale_tokens_dropped(r, settings):
    # each arrival rang the tier's bell; once the tier is found empty those tokens would
    # each cost a waiting dispatcher an empty pick
    s, plan = make(settings, "wfq")
    bell = Keys(s.key_prefix).tier_bell("default", "vip")
    for i in range(3):
        push(r, s, "vip", tenant=f"t{i}")
    assert r.llen(bell) == 3
    assert len(scripts_for(r).run(plan.batch(3))) == 3      # took all, did not look further
    assert r.llen(bell) == 3
    assert pick(r, plan) == Wait(-1)                         # found empty: flagged, bell emptied
    assert r.llen(bell) == 0 and flags(r, s)["vip"] == "set"
    push(r, s, "vip", tenant="late")
    assert r.llen(bell) == 1                                 # an arrival rings it again
    assert isinstance(pick(r, plan), Picked)
    assert r.llen(bell) == 1                                 # not found empty yet: kept


def test_a_tenants_next_task_read_with_its_head_keeps_its_order(r, settings, key_prefix):
    # the dispatch puts the tenant's next entry in line from the candidate's read: single
    # calls and batches alike take one tenant's tasks oldest first
    s, plan = make(settings, "wfq")
    mine = [push(r, s, "normal", tenant="acme") for _ in range(5)]
    theirs = [push(r, s, "normal", tenant="zeta") for _ in range(5)]
    order = [pick(r, plan).tag for _ in range(3)]
    for got in scripts_for(r).run(plan.batch(7)):
        order.append(got.tag)
    assert [t for t in order if t in mine] == mine
    assert [t for t in order if t in theirs] == theirs
    assert pick(r, plan) == Wait(-1)


def test_a_flag_lasts_a_second_so_a_tenant_let_in_without_clearing_it_waits_no_longer(r, settings):
    # a producer of a release before the flag (a rolling upgrade) adds a tenant to an empty
    # active set without clearing it: the tier is read again once the flag's second is over
    s, plan = make(settings, "wfq")
    keys = Keys(s.key_prefix)
    assert pick(r, plan) == Wait(-1)
    tag = push(r, s, "normal", tenant="acme")
    now = redis_now_ms(r)
    r.hset(keys.fair("default"), "e:normal", now + 60_000)   # as if the arrival left it set
    assert pick(r, plan) == Wait(-1)                        # skipped while the flag holds
    r.hset(keys.fair("default"), "e:normal", now - 1)       # its time is over
    assert pick(r, plan).tag == tag


def _dispatchable(r, s, inflight: Counter, cap: int) -> bool:
    """Whether any queued task's tenant is under its cap (in any tier): then a pick on a
    pool that never waits for tokens must dispatch something."""
    keys = Keys(s.key_prefix)
    for tier in TIERS:
        for raw in r.zrange(keys.index("default", tier), 0, -1):
            if inflight[IndexEntry.decode(raw.decode()).tenant] < cap:
                return True
    return False


def test_random_mix_never_leaves_dispatchable_work_behind_a_flag(r, settings):
    rnd = random.Random(8)
    cap = 2
    s, plan = make(settings, "wfq", tiers=capped(cap))
    keys = Keys(s.key_prefix)
    # each tenant in one tier, as its registry entry says (its in-flight count is the pool's)
    tenants = {f"t{i}": TIERS[i % 3] for i in range(6)}
    queued: dict[str, tuple[str, str]] = {}     # tag -> (tier, tenant)
    running: dict[str, str] = {}                # tag -> tenant
    inflight: Counter = Counter()
    pushed, cancelled, acked = set(), set(), Counter()
    picks_that_found_nothing = 0

    def take(batch: int) -> None:
        nonlocal picks_that_found_nothing
        got = scripts_for(r).run(plan.batch(batch))
        if isinstance(got, Wait):
            picks_that_found_nothing += 1
            assert not _dispatchable(r, s, inflight, cap), (got, flags(r, s))
            return
        for p in got:
            queued.pop(p.tag)
            running[p.tag] = p.tenant
            inflight[p.tenant] += 1

    for _ in range(400):
        op = rnd.random()
        if op < 0.35:
            tenant = rnd.choice(sorted(tenants))
            tier = tenants[tenant]
            tag = push(r, s, tier, tenant=tenant)
            queued[tag] = (tier, tenant)
            pushed.add(tag)
        elif op < 0.65:
            take(rnd.choice((1, 1, 3)))
        elif op < 0.85 and running:
            tag = rnd.choice(sorted(running))
            mode = rnd.choice(("ack", "ack", "requeue"))
            done = release(r, s, tag, mode)
            assert done.released
            tenant = running.pop(tag)
            inflight[tenant] -= 1
            if mode == "requeue":
                queued[tag] = (done.tier, tenant)
            else:
                acked[tag] += 1
        elif queued:
            tag = rnd.choice(sorted(queued))
            tier, tenant = queued.pop(tag)
            ref = TaskRef("default", tier, tenant, tag)
            outcome = scripts_for(r).run(CancelCall(keys, tag, ref, find_entry(r, keys, ref),
                                                    s.tier(tier).scheduled_lag_tokens))
            assert outcome == "queued"
            cancelled.add(tag)
    assert picks_that_found_nothing > 10         # the flag was set and cleared many times
    # drain: ack everything running, pick until nothing is left
    while queued or running:
        for tag in sorted(running):
            assert release(r, s, tag).released
            inflight[running.pop(tag)] -= 1
            acked[tag] += 1
        before = len(queued)
        take(3)
        assert len(queued) < before or not queued
    # every task not cancelled ran to its ack exactly once
    assert set(acked) == pushed - cancelled and set(acked.values()) == {1}
    assert pick(r, plan) == Wait(-1)
