"""lua/dispatch/pick.lua against a real Redis: ordering per policy, fair shares, aging,
starvation bound, tenant caps, pool isolation, and a bucket that never
overshoots under concurrent dispatchers."""

from __future__ import annotations

from dataclasses import replace

import json
import threading
import time
import uuid
from collections import Counter

import pytest

from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.keys import Keys
from gateway_tasks.bucket.calls import DrainCall
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.dispatch.release import ReleaseCall, Released
from gateway_tasks.dispatch.request import HEADER_DISPATCH
from gateway_tasks.dispatch.record import Dispatch
from gateway_tasks.dispatch.router import PickPlan, Picked, Wait, pick_now
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool, Settings, default_tiers

BIG = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
           tpm=10**9, rpm=10**9)




def dispatch_of(picked: Picked) -> Dispatch:
    """What the pick decided, as the task reads it from the message."""
    got = Dispatch.decode(picked.payload["headers"][HEADER_DISPATCH])
    assert got is not None
    return got

def push(r, settings: Settings, tier: str, *, est: int = 100, tenant: str | None = None,
         enq_ms: int | None = None, pool: str = "default", weight: float = 1.0) -> str:
    """Queue a minimal kombu envelope through enqueue.lua (as the producer's transport does)."""
    queue = settings.queue_name(tier, pool)
    tag = uuid.uuid4().hex
    tenant = tenant or f"tenant-{tag[:8]}"
    msg = {"body": "", "headers": {"gt_est_tokens": est, "gt_tenant": tenant, "id": tag},
           "properties": {"delivery_tag": tag,
                          "delivery_info": {"exchange": "", "routing_key": queue}}}
    done = enqueue(r, EnqueueCall(Keys(settings.key_prefix), settings.tier(tier), pool,
                                  tenant, tag, est, json.dumps(msg), tenant_weight=weight,
                                          enqueued_ms=enq_ms))
    assert done.accepted
    return tag


def vip_expected(r, settings: Settings, pool: str = "default") -> None:
    """Vip work arrived on the pool just now (as enqueue.lua marks it): its reserve is held."""
    now_s, now_us = r.time()
    r.hset(Keys(settings.key_prefix).fair(pool), "rsv_ms", now_s * 1000 + now_us // 1000)


def pick(r, plan: PickPlan):
    return pick_now(scripts_for(r), plan)


def drain_order(r, plan: PickPlan, n: int) -> list[str]:
    tiers = []
    for _ in range(n):
        got = pick(r, plan)
        assert isinstance(got, Picked), got
        tiers.append(got.queue.split(".")[1])
    return tiers


def make(settings: Settings, policy: str, pools=(BIG,), tiers=None) -> tuple[Settings, PickPlan]:
    s = settings.with_(policy=policy, pools=tuple(pools), tiers=tiers or settings.tiers)
    return s, PickPlan(s, s.queue_names())


def test_empty_queues_wait_forever(r, settings):
    s, plan = make(settings, "wfq")
    assert pick(r, plan) == Wait(-1)


@pytest.mark.parametrize("policy,expected", [
    ("fifo", ["batch", "normal", "vip"]),      # oldest first, tiers ignored
    ("strict", ["vip", "normal", "batch"]),    # tier weight, always
])
def test_fifo_and_strict_order(r, settings, policy, expected):
    s, plan = make(settings, policy)
    now = redis_now_ms(r)
    push(r, s, "batch", enq_ms=now - 300)
    push(r, s, "normal", enq_ms=now - 200)
    push(r, s, "vip", enq_ms=now - 100)
    assert drain_order(r, plan, 3) == expected


def test_aging_score_promotes_old_batch_over_fresh_vip(r, settings):
    # Score = BaseWeight + alpha * wait_ms: batch 1 + 0.005*w beats vip 100 + 0.05*0 once w > 19.8 s
    s, plan = make(settings, "aging")
    now = redis_now_ms(r)
    push(r, s, "vip", enq_ms=now)
    push(r, s, "batch", enq_ms=now - 25_000)
    assert drain_order(r, plan, 2) == ["batch", "vip"]
    push(r, s, "vip", enq_ms=now)
    push(r, s, "batch", enq_ms=now - 10_000)   # 1 + 50 < 100: vip first
    assert drain_order(r, plan, 2) == ["vip", "batch"]


def test_fifo_within_a_tenant(r, settings):
    s, plan = make(settings, "wfq")
    tags = [push(r, s, "normal", tenant="acme") for _ in range(5)]
    got = [pick(r, plan).payload["properties"]["delivery_tag"] for _ in range(5)]
    assert got == tags


def test_wfq_token_shares_70_20_10_when_all_backlogged(r, settings):
    s, plan = make(settings, "wfq")
    now = redis_now_ms(r)
    for tier in ("vip", "normal", "batch"):
        for _ in range(400):
            push(r, s, tier, est=100, enq_ms=now)
    tiers = drain_order(r, plan, 500)
    shares = Counter(tiers)
    assert abs(shares["vip"] / 500 - 0.70) <= 0.03
    assert abs(shares["normal"] / 500 - 0.20) <= 0.03
    assert abs(shares["batch"] / 500 - 0.10) <= 0.03


def test_wfq_shares_are_token_weighted(r, settings):
    # batch sends 4x larger requests: it gets 10% of tokens, so 1/4 as many requests per token
    s, plan = make(settings, "wfq")
    now = redis_now_ms(r)
    for _ in range(300):
        push(r, s, "vip", est=100, enq_ms=now)
        push(r, s, "batch", est=400, enq_ms=now)
    tiers = drain_order(r, plan, 300)
    tokens = Counter()
    for t in tiers:
        tokens[t] += 100 if t == "vip" else 400
    share_batch = tokens["batch"] / sum(tokens.values())
    assert abs(share_batch - 10 / 80) <= 0.03   # only vip and batch are backlogged: 70:10


def test_wfq_idle_tier_banks_no_credit(r, settings):
    s, plan = make(settings, "wfq")
    now = redis_now_ms(r)
    for _ in range(200):
        push(r, s, "vip", est=100, enq_ms=now)
    drain_order(r, plan, 100)          # batch idle all along
    for _ in range(50):
        push(r, s, "batch", est=100, enq_ms=now)
    order = drain_order(r, plan, 40)
    # had batch banked the 100 dispatches it skipped it would now run ~all 40 in a row
    assert Counter(order)["batch"] <= 10


def test_wfq_promotes_past_max_wait(r, settings):
    s, plan = make(settings, "wfq")
    now = redis_now_ms(r)
    batch_max = s.tier("batch").max_wait_ms
    for _ in range(20):
        push(r, s, "vip", enq_ms=now)
    push(r, s, "batch", enq_ms=now - batch_max - 1_000)
    assert drain_order(r, plan, 1) == ["batch"]


def test_wfq_shares_hold_when_every_head_is_past_its_max_wait(r, settings):
    # a long backlog: every head has waited past its tier's max_wait_ms (vip: 2 s);
    # promotion must not hand the tier with the shortest max wait the whole pool
    # (stale-drop off: with VIP's 15 s queue TTL these heads would all be stale)
    s, plan = make(settings, "wfq", tiers=tuple(replace(t, queue_ttl_s=0.0) for t in settings.tiers))
    old = redis_now_ms(r) - 400_000
    for tier in ("vip", "normal", "batch"):
        for _ in range(400):
            push(r, s, tier, est=100, enq_ms=old)
    shares = Counter(drain_order(r, plan, 500))
    assert abs(shares["vip"] / 500 - 0.70) <= 0.03
    assert abs(shares["normal"] / 500 - 0.20) <= 0.03
    assert abs(shares["batch"] / 500 - 0.10) <= 0.03

def test_starvation_bound_under_vip_flood(r, settings):
    # a continuous VIP backlog cannot starve batch under wfq: batch gets its share
    s, plan = make(settings, "wfq")
    now = redis_now_ms(r)
    for _ in range(300):
        push(r, s, "vip", enq_ms=now)
    for _ in range(30):
        push(r, s, "batch", enq_ms=now)
    order = drain_order(r, plan, 100)
    first_batch = order.index("batch")
    assert first_batch <= 10  # 70:10 -> one batch per ~8 vip
    gaps = [i for i, t in enumerate(order) if t == "batch"]
    assert max(b - a for a, b in zip(gaps, gaps[1:])) <= 10


def test_bucket_admission_and_wait_hint(r, settings):
    small = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                 tpm=6_000, rpm=10_000)   # 100 tokens/s, capacity 6000
    tiers = tuple(t if t.name != "vip" else t for t in default_tiers())
    s, plan = make(settings, "wfq", pools=(small,), tiers=tiers)
    push(r, s, "vip", est=5_000)
    push(r, s, "vip", est=5_000)
    assert isinstance(pick(r, plan), Picked)
    got = pick(r, plan)
    assert isinstance(got, Wait)
    # 1000 left, needs 5000: ~40 s of refill at 100 tokens/s
    assert 35_000 <= got.wait_ms <= 41_000


def test_reserve_is_for_vip_only_and_held_only_while_vip_work_is_expected(r, settings):
    def small(name: str) -> Pool:   # capacity 1000, vip reserves 20% = 200
        return Pool(name, base_url="http://127.0.0.1:1/v1", api_key="x", models=(f"m{name}",),
                    tpm=1_000, rpm=10_000)

    # no vip work queued or seen on the pool: batch work may use the reserve too
    s, plan = make(settings, "wfq", pools=(small("idle"),))
    push(r, s, "batch", est=450, pool="idle")
    push(r, s, "batch", est=450, pool="idle")
    assert isinstance(pick(r, plan), Picked)   # 1000 -> 550
    assert isinstance(pick(r, plan), Picked)   # 550 -> 100: the reserve was not held back
    # vip work arrived lately (within reserve_hold_s): the reserve is held back for it
    s, plan = make(settings, "wfq", pools=(small("busy"),))
    push(r, s, "vip", est=10, pool="busy")
    assert isinstance(pick(r, plan), Picked)   # 1000 -> 990
    push(r, s, "batch", est=450, pool="busy")
    push(r, s, "batch", est=450, pool="busy")
    assert isinstance(pick(r, plan), Picked)   # 990 -> 540
    got = pick(r, plan)
    assert isinstance(got, Wait)     # 540 - 450 < 200 reserve
    push(r, s, "vip", est=500, pool="busy")
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.queue == "gt.vip.busy"


def test_saturated_pool_does_not_block_another(r, settings):
    a = Pool("a", base_url="http://127.0.0.1:1/v1", api_key="x", models=("ma",), tpm=1_000, rpm=1_000)
    b = Pool("b", base_url="http://127.0.0.1:1/v1", api_key="x", models=("mb",), tpm=10**6, rpm=10**6)
    s, plan = make(settings, "wfq", pools=(a, b))
    keys = Keys(s.key_prefix)
    scripts_for(r).run(DrainCall(keys, a, retry_after_ms=60_000))
    for _ in range(5):
        push(r, s, "vip", pool="a")
    push(r, s, "batch", pool="b")
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.queue == "gt.batch.b"
    assert isinstance(pick(r, plan), Wait)


def test_tenant_concurrency_cap_skips_to_next_tenant(r, settings):
    tiers = tuple(t.__class__(**{**t.__dict__, "max_concurrency_per_tenant": 1}) for t in default_tiers())
    s, plan = make(settings, "wfq", tiers=tiers)
    push(r, s, "normal", tenant="hog")
    push(r, s, "normal", tenant="hog")
    other = push(r, s, "normal", tenant="polite")
    first = pick(r, plan)
    assert first.payload["headers"]["gt_tenant"] == "hog"
    second = pick(r, plan)
    assert second.payload["properties"]["delivery_tag"] == other
    assert isinstance(pick(r, plan), Wait)           # hog is at its cap: parked, not blocking
    keys = Keys(s.key_prefix)
    assert r.hget(keys.parked("default"), "hog") == b"normal"
    assert r.zscore(keys.active("default", "normal"), "hog") is None
    released = scripts_for(r).run(ReleaseCall(keys, s, "default", first.tag))   # the ack frees the slot
    assert released == Released(True, "hog", "normal")
    assert r.hget(keys.parked("default"), "hog") is None
    assert pick(r, plan).payload["headers"]["gt_tenant"] == "hog"


def test_pick_records_unacked_atomically(r, settings):
    s, plan = make(settings, "wfq")
    tag = push(r, s, "vip")
    got = pick(r, plan)
    keys = Keys(s.key_prefix)
    tier, token, entry = r.hget(keys.dispatched("default"), tag).decode().split("|", 2)
    assert tier == "vip" and IndexEntry.decode(entry).tag == tag == got.tag
    assert int(token) == got.dispatched_ms                      # the dispatch's token
    assert r.zscore(keys.dispatched_at("default"), tag) is not None
    assert json.loads(r.hget(keys.messages("default"), tag))["properties"]["delivery_tag"] == tag
    assert r.zcard(keys.index("default", "vip")) == 0
    assert int(r.hget(keys.inflight("default"), got.tenant)) == 1
    d = dispatch_of(got)
    assert d.dispatched_ms >= d.enqueued_ms and (d.tag, d.pool, d.tier, d.tenant) == (got.tag, "default", "vip", got.tenant)
    assert (d.debited_tokens, d.debited_request, d.stale) == (got.est_tokens, True, False)


def test_concurrent_dispatchers_never_overshoot_the_bucket(r, settings):
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=600, rpm=10**6)   # capacity 600 tokens, refill 10 tokens/s
    s, _ = make(settings, "wfq", pools=(pool,))
    for tier in ("vip", "normal", "batch"):
        for _ in range(100):
            push(r, s, tier, est=7)
    picked: list[int] = []
    start = redis_now_ms(r)

    def run():
        plan = PickPlan(s, s.queue_names())
        import redis as redis_mod
        client = redis_mod.Redis(connection_pool=r.connection_pool)
        while True:
            got = pick(client, plan)
            if isinstance(got, Wait):
                return
            picked.append(got.est_tokens)

    threads = [threading.Thread(target=run) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    elapsed_ms = redis_now_ms(r) - start
    admitted = sum(picked)
    assert admitted <= 600 + elapsed_ms * 600 / 60_000 + 1e-9
    assert admitted >= 600 - 200 - 7   # work-conserving down to the vip reserve


def test_settle_refunds_and_sync_only_lowers(r, settings):
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=6_000, rpm=600)
    s, plan = make(settings, "wfq", pools=(pool,))
    bucket = PoolBucket(r, Keys(s.key_prefix), pool)
    push(r, s, "vip", est=1_000)
    pick(r, plan)
    level = bucket.level()["tokens"]
    assert level <= 5_000 + 50
    after = bucket.settle(est_tokens=1_000, actual_tokens=300, tier="vip", tenant_id="t",
                          model="m", completion_tokens=200)
    assert after >= level + 700 - 1e-6 and after <= 6_000
    assert bucket.learned_completion("t", "m") == 200
    lowered = bucket.sync({"x-ratelimit-remaining-tokens": "1234", "x-ratelimit-remaining-requests": "9"})
    assert lowered == (1234.0, 9.0)
    same = bucket.sync({"x-ratelimit-remaining-tokens": "5999"})
    assert same[0] < 1300   # never raised by the upstream's view


def test_a_refund_rings_the_pools_bell_only_while_a_dispatcher_waits_for_the_bucket(r, settings):
    # a refund nobody waits for would wake an idle dispatcher for an empty pick
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=6_000, rpm=600)   # capacity 6000 tokens, 100 a second
    s, plan = make(settings, "wfq", pools=(pool,))
    keys = Keys(s.key_prefix)
    bucket = PoolBucket(r, keys, pool)

    def refund() -> None:
        bucket.settle(est_tokens=1_000, actual_tokens=300, tier="vip", tenant_id="t", model="m",
                      completion_tokens=200)

    push(r, s, "vip", est=1_000)
    assert isinstance(pick(r, plan), Picked)
    refund()
    assert r.llen(keys.bell("default")) == 0            # nobody waits for tokens
    push(r, s, "vip", est=5_900)                         # more than is left: waits for tokens
    wait = pick(r, plan)
    assert isinstance(wait, Wait) and wait.wait_ms > 0
    until = int(r.hget(keys.bucket("default"), "wait_until_ms"))
    assert until >= redis_now_ms(r)
    refund()
    assert r.llen(keys.bell("default")) == 1            # the waiting dispatcher is woken
    r.hset(keys.bucket("default"), "wait_until_ms", until - 60_000)   # that wait is over
    refund()
    assert r.llen(keys.bell("default")) == 1


def test_a_late_reply_does_not_undo_debits_made_after_its_dispatch(r, settings):
    """x-ratelimit-remaining describes the upstream when it answered task A; tasks the
    gateway dispatched after A cannot be in it yet, so the sync keeps their debits."""
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=6_000, rpm=600)
    s, plan = make(settings, "wfq", pools=(pool,))
    bucket = PoolBucket(r, Keys(s.key_prefix), pool)
    push(r, s, "vip", est=1_000, tenant="a")
    push(r, s, "vip", est=2_000, tenant="b")
    a = pick(r, plan)
    b = pick(r, plan)                                     # dispatched after a, not seen upstream yet
    assert (a.tenant, b.tenant) == ("a", "b")
    level = bucket.level()["tokens"]                      # ~ 6000 - 3000
    # a's reply: the upstream saw only a (6000 - 1000 left); b's 2000 must stay debited
    synced = bucket.sync({"x-ratelimit-remaining-tokens": "5000", "x-ratelimit-remaining-requests": "99"},
                         dispatch_of(a).pool_debited_total, dispatch_of(a).pool_dispatches_total)
    assert synced[0] <= min(level + 5, 3_000 + 5)          # not raised back to 5000: b is still counted
    assert synced[1] <= 98                                # b's request slot too
    stale = bucket.sync({"x-ratelimit-remaining-tokens": "2500"},
                        dispatch_of(a).pool_debited_total, dispatch_of(a).pool_dispatches_total)
    assert stale[0] <= 500 + 5                            # 2500 seen at a, minus b's 2000


def test_settle_follows_the_replys_remaining_headers_in_the_same_call(r, settings):
    """The worker's one call after an upstream reply: refund to the real usage, then lower
    to what the reply says is left minus what was dispatched after it, and the Redis time."""
    from gateway_tasks.core.clock import redis_now_ms as now_ms
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=6_000, rpm=600)
    s, plan = make(settings, "wfq", pools=(pool,))
    bucket = PoolBucket(r, Keys(s.key_prefix), pool)
    push(r, s, "vip", est=1_000, tenant="a")
    push(r, s, "vip", est=2_000, tenant="b")
    a, b = pick(r, plan), pick(r, plan)
    assert (a.tenant, b.tenant) == ("a", "b")
    common = dict(est_tokens=1_000, tier="vip", tenant_id="a", model="m", completion_tokens=100,
                  debited_tokens_at_dispatch=dispatch_of(a).pool_debited_total,
                  dispatches_at_dispatch=dispatch_of(a).pool_dispatches_total)
    # no headers: a refund of 700 only (~3000 + 700 left)
    before = now_ms(r)
    plain = bucket.settle_reply(actual_tokens=300, **common)
    assert 3_700 - 5 <= plain.tokens <= 3_700 + 50 and plain.now_ms >= before
    # the reply says 2500 left when it answered a: b's 2000 came after, so 500 is left
    followed = bucket.settle_reply(actual_tokens=1_000, headers={"x-ratelimit-remaining-tokens": "2500",
                                                                  "x-ratelimit-remaining-requests": "50"},
                                   **common)
    assert followed.tokens <= 500 + 5 and followed.requests <= 49


def test_settle_and_reads_in_one_round_trip_even_after_the_server_lost_its_scripts(settings):
    """The worker settles, marks the task done for its dependants and reads its cancel mark in
    one pipeline; a server that lost its scripts (restart, SCRIPT FLUSH) gets them loaded, each
    script runs once, the reads are sent again."""
    import redis as redis_lib

    from gateway_tasks.lifecycle.depends import Done, done_call
    from gateway_tasks.local.redis_server import EmbeddedRedis
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=6_000, rpm=600)
    keys = Keys(settings.key_prefix)
    with EmbeddedRedis() as server:          # private: flushing its scripts disturbs nobody
        client = redis_lib.Redis.from_url(server.url)
        bucket = PoolBucket(client, keys, pool)
        client.set("mark", "running")
        common = dict(tier="vip", tenant_id="a", model="m", completion_tokens=0)
        first, done, reads = bucket.settle_reply_and_read([("GET", "mark"), ("GET", "none")], est_tokens=100,
                                                          actual_tokens=3_000, **common)   # 2,900 more used
        assert 3_100 - 5 <= first.tokens <= 3_100 + 50
        assert reads == [b"running", None] and done == []
        client.sadd(keys.waiters("t1"), "child-a")
        client.sadd(keys.waiters("t2"), "child-b")
        client.set(keys.cancelled("t2"), "running")
        client.script_flush()
        second, done, reads = bucket.settle_reply_and_read(
            [("GET", "mark")], [done_call(keys, "t1"), done_call(keys, "t2")], est_tokens=1_000,
            actual_tokens=0, **common)
        assert reads == [b"running"]
        assert 1_000 - 5 <= second.tokens - first.tokens <= 1_000 + 50   # refunded once, not twice
        # t1 succeeded; t2 was cancelled while its call ran: its dependants hear it failed
        assert done == [Done("ok", ("child-a",)), Done("failed", ("child-b",))]
        assert client.get(keys.done("t1")) == b"ok" and client.get(keys.done("t2")) == b"failed"
        # only marked: the waiters stay until the task's end hands them over (depends.finish)
        assert client.smembers(keys.waiters("t1")) == {b"child-a"}
        client.close()


def test_drain_blocks_the_pool_until_retry_after(r, settings):
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    s, plan = make(settings, "wfq")
    bucket = PoolBucket(r, Keys(s.key_prefix), s.pools[0])
    bucket.drain(5_000)
    push(r, s, "vip", est=1)
    got = pick(r, plan)
    assert isinstance(got, Wait) and 4_000 <= got.wait_ms <= 5_000
    stats = r.hgetall(Keys(s.key_prefix).stats("default"))
    assert stats[b"upstream_429"] == b"1"


def test_request_bigger_than_bucket_minus_reserve_is_admitted_on_a_full_bucket(r, settings):
    small = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                 tpm=1_000, rpm=10_000)   # capacity 1000, vip reserve 200
    s, plan = make(settings, "wfq", pools=(small,))
    push(r, s, "batch", est=950)      # 950 + 200 > 1000: never fits beside the reserve
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.est_tokens == 950


def test_wfq_vip_goes_around_a_winner_waiting_for_tokens_within_its_reservation(r, settings):
    small = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                 tpm=6_000, rpm=10_000)   # 100 tokens/s, capacity 6000, vip reserve 1200
    s, plan = make(settings, "wfq", pools=(small,))
    keys = Keys(s.key_prefix)
    push(r, s, "vip", est=100)
    assert pick(r, plan).queue == "gt.vip.default"    # vip is now 100 tokens ahead (v = 0)
    push(r, s, "batch", est=5_000)                    # fair order: batch next, but 5900 < 5000 + 1200
    push(r, s, "vip", est=100)
    got = pick(r, plan)
    assert isinstance(got, Picked) and got.queue == "gt.vip.default"
    assert float(r.hget(keys.fair("default"), "v")) == 0.0   # batch keeps its place
    assert isinstance(pick(r, plan), Wait)


def test_wfq_vip_past_its_reservation_waits_in_fair_order(r, settings):
    small = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                 tpm=6_000, rpm=10_000)
    s, plan = make(settings, "wfq", pools=(small,))
    keys = Keys(s.key_prefix)
    r.hset(keys.fair("default"), mapping={"v": 0, "f:vip": 1_300 / 70})  # 1300 tokens ahead > 1200
    push(r, s, "batch", est=5_000)
    push(r, s, "vip", est=100)
    r.hset(keys.bucket("default"), mapping={"tokens": 5_900, "requests": 100,
                                            "ts_ms": redis_now_ms(r)})
    assert isinstance(pick(r, plan), Wait)


# -- tenant fair queuing inside a tier ------------------------------------------------------
def tenants_of(r, plan: PickPlan, n: int) -> list[str]:
    """The tenants of the next n dispatches, each acked at once (so caps never bind)."""
    out = []
    for _ in range(n):
        got = pick(r, plan)
        assert isinstance(got, Picked), got
        assert scripts_for(r).run(ReleaseCall(plan.keys, plan.settings, got.pool, got.tag)).released
        out.append(got.tenant)
    return out


def test_quiet_tenants_go_ahead_of_a_flooding_tenants_backlog(r, settings):
    s, plan = make(settings, "wfq")
    for _ in range(400):
        push(r, s, "normal", tenant="flood", est=500)
    assert tenants_of(r, plan, 3) == ["flood"] * 3
    for i in range(4):
        push(r, s, "normal", tenant=f"quiet{i}", est=500)
    # the next five picks serve every quiet tenant once, the flood at most once
    nxt = tenants_of(r, plan, 5)
    assert sorted(t for t in nxt if t != "flood") == ["quiet0", "quiet1", "quiet2", "quiet3"]
    assert r.zcard(Keys(s.key_prefix).index("default", "normal")) == 400 - 3 - 1


def test_tenant_weights_share_a_tier_by_tokens(r, settings):
    s, plan = make(settings, "wfq")
    for _ in range(300):
        push(r, s, "batch", tenant="big", est=100, weight=3)
        push(r, s, "batch", tenant="small", est=100, weight=1)
    counts = Counter(tenants_of(r, plan, 200))
    assert counts["big"] == pytest.approx(150, abs=3) and counts["small"] == pytest.approx(50, abs=3)


def test_token_weighted_not_request_weighted_between_tenants(r, settings):
    s, plan = make(settings, "wfq")
    for _ in range(200):
        push(r, s, "batch", tenant="long", est=400)
        push(r, s, "batch", tenant="short", est=100)
    counts = Counter(tenants_of(r, plan, 100))
    assert counts["short"] == pytest.approx(80, abs=3)    # 4 short for every long: equal tokens


def test_an_idle_tenant_banks_no_credit(r, settings):
    s, plan = make(settings, "wfq")
    for _ in range(300):
        push(r, s, "normal", tenant="busy")
    assert tenants_of(r, plan, 100) == ["busy"] * 100     # a lone tenant may use the whole tier
    for _ in range(100):
        push(r, s, "normal", tenant="late")
    counts = Counter(tenants_of(r, plan, 100))
    # 'late' was idle while 'busy' was served: it starts at the tier's virtual time, not 100 behind
    assert counts["late"] == pytest.approx(50, abs=2)


def test_requeue_returns_to_the_front_of_its_tenants_line_with_its_enqueue_time(r, settings):
    s, plan = make(settings, "wfq")
    keys = Keys(s.key_prefix)
    now = redis_now_ms(r)
    first = push(r, s, "vip", tenant="acme", enq_ms=now - 5_000)
    push(r, s, "vip", tenant="acme")
    got = pick(r, plan)
    assert got.tag == first
    assert scripts_for(r).run(ReleaseCall(keys, s, "default", first, "requeue")).released
    assert not scripts_for(r).run(ReleaseCall(keys, s, "default", first, "requeue")).released  # once
    again = pick(r, plan)
    assert again.tag == first and dispatch_of(again).enqueued_ms == now - 5_000
    assert r.hget(keys.inflight("default"), "acme") == b"1"


def test_every_key_of_a_dispatch_shares_the_pools_hash_slot(r, settings):
    from devtools.redis_cluster import slot_of
    two = (BIG, Pool("other", base_url="http://127.0.0.1:1/v1", api_key="x", models=("n",),
                     tpm=10**9, rpm=10**9))
    s = settings.with_(pools=two)
    keys = Keys(s.key_prefix)
    for pool in two:
        tier = s.tiers[0]
        calls = [PickPlan(s, [s.queue_name(t.name, pool.name) for t in s.tiers]),
                 EnqueueCall(keys, tier, pool.name, "acme", "tag", 1, "{}", task_id="t-1", ref_ttl_s=60),
                 ReleaseCall(keys, s, pool.name, "tag")]
        slots = {slot_of(k) for call in calls for k in call.script_keys}
        assert slots == {slot_of(keys.pool_tag(pool.name))}, pool.name
    assert slot_of(keys.bucket("default")) != slot_of(keys.bucket("other"))


# -- leases ---------------------------------------------------------------------------------
def test_an_expired_lease_is_swept_once_and_its_late_holder_is_told_it_is_stale(r, settings):
    from gateway_tasks.dispatch.leases import sweep_expired
    from gateway_tasks.dispatch.release import RenewCall

    s, plan = make(settings, "wfq")
    keys = Keys(s.key_prefix)
    scripts = scripts_for(r)
    tag = push(r, s, "vip", tenant="acme")
    first = pick(r, plan)
    token = str(first.dispatched_ms)
    # a live holder renews its lease; nobody may renew a dispatch that is not theirs
    assert scripts.run(RenewCall(keys, "default", ((tag, token),), 60_000, 3_600_000)) == 1
    assert scripts.run(RenewCall(keys, "default", ((tag, "123"),), 60_000, 3_600_000)) == 0
    assert sweep_expired(r, scripts, keys, s) == 0                  # not expired: left alone
    r.zadd(keys.dispatched_at("default"), {tag: 1.0})               # the holder died long ago
    assert sweep_expired(r, scripts, keys, s) == 1
    assert sweep_expired(r, scripts, keys, s) == 0                  # exactly once
    assert r.hget(keys.inflight("default"), "acme") is None         # its slot is free
    time.sleep(0.002)                # a dispatch's token is its Redis ms: a lease lasts >= 0.5 s
    second = pick(r, plan)
    assert second.tag == tag and second.dispatched_ms > first.dispatched_ms
    # the first holder wakes up (SIGSTOP) and acks: detected, counted, the new dispatch untouched
    late = scripts.run(ReleaseCall(keys, s, "default", tag, "ack", token))
    assert late == Released(False, stale=True)
    assert r.hget(keys.stats("default"), "stale_releases") == b"1"
    assert r.hexists(keys.dispatched("default"), tag)
    assert scripts.run(ReleaseCall(keys, s, "default", tag, "ack", str(second.dispatched_ms))).released
    # the late holder acks again after the re-run was acked (nothing dispatched any more): still stale
    assert scripts.run(ReleaseCall(keys, s, "default", tag, "ack", token)) == Released(False, stale=True)
    assert r.hget(keys.stats("default"), "stale_releases") == b"2"
    assert scripts.run(ReleaseCall(keys, s, "default", tag, "ack")) == Released(False)   # no token: not counted


def test_a_lease_is_not_renewed_past_the_visibility_timeout(r, settings):
    from gateway_tasks.dispatch.release import RenewCall

    s, plan = make(settings, "wfq")
    keys = Keys(s.key_prefix)
    tag = push(r, s, "vip")
    got = pick(r, plan)
    time.sleep(0.002)                                  # older than a visibility timeout of 1 ms
    assert scripts_for(r).run(RenewCall(keys, "default", ((tag, str(got.dispatched_ms)),), 5_000, 1)) == 0


def test_one_call_taking_several_tasks_dispatches_as_that_many_single_calls(r, settings, key_prefix):
    """pick.lua with ARGV max picks 6 dispatches in exactly the order of 6 single picks."""
    orders = []
    for name in ("single", "batch"):
        s, plan = make(settings.with_(key_prefix=f"{key_prefix}{name}:"), "wfq")
        now = redis_now_ms(r)
        for i in range(12):   # every tier, three tenants, fixed enqueue times
            for tier in ("vip", "normal", "batch"):
                push(r, s, tier, tenant=f"{tier}-t{i % 3}", est=100 + 50 * (i % 4), enq_ms=now - 100 + i)
        got: list[Picked] = []
        while len(got) < 24:
            if name == "single":
                got.append(pick(r, plan))
            else:
                batch = scripts_for(r).run(plan.batch(6))
                assert isinstance(batch, list) and len(batch) == 6
                got.extend(batch)
        orders.append([(g.tier, g.tenant, g.est_tokens) for g in got])
        keys = Keys(s.key_prefix)
        assert r.zcard(keys.dispatched_at("default")) == 24
        assert sum(int(v) for v in r.hvals(keys.inflight("default"))) == 24
    assert orders[0] == orders[1]


def test_a_batch_stops_at_a_tenants_cap_and_at_the_bucket(r, settings):
    tiers = tuple(t.__class__(**{**t.__dict__, "max_concurrency_per_tenant": 2}) for t in default_tiers())
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=60_000, rpm=10**6)   # capacity 60000 tokens (the reserve is 10% of it)
    s, plan = make(settings, "wfq", pools=(pool,), tiers=tiers)
    for _ in range(5):
        push(r, s, "normal", tenant="hog", est=1000)
    for i in range(3):
        push(r, s, "normal", tenant=f"other{i}", est=1000)
    got = scripts_for(r).run(plan.batch(32))
    assert Counter(g.tenant for g in got) == {"hog": 2, "other0": 1, "other1": 1, "other2": 1}
    assert r.hget(Keys(s.key_prefix).parked("default"), "hog") == b"normal"
    assert isinstance(scripts_for(r).run(plan.batch(32)), Wait)     # hog capped, the rest empty
    for _ in range(100):
        push(r, s, "batch", est=5000)
    vip_expected(r, s)
    got = scripts_for(r).run(plan.batch(32))
    # batch leaves the vip reserve alone: as many tasks of 5000 as fit beside it
    reserve = pool.token_capacity * max(t.reserved_share for t in s.tiers)
    assert len(got) == int((pool.token_capacity - 5000 - reserve) // 5000) and all(g.tier == "batch" for g in got)
    wait = scripts_for(r).run(plan.batch(32))
    assert isinstance(wait, Wait) and wait.wait_ms > 0


class _RawBatch:
    """A pick batch whose reply comes back unparsed (its wait hint read by PickBatch)."""

    SCRIPT = "dispatch/pick"

    def __init__(self, batch):
        self.script_keys, self.script_args = batch.script_keys, batch.script_args

    @staticmethod
    def parse(reply):
        return reply


def test_a_batch_that_took_fewer_than_asked_says_what_its_other_slots_face(r, settings):
    from gateway_tasks.dispatch.router import PickBatch
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=60_000, rpm=10**6)   # capacity 60000 tokens, refilled at 1 a ms
    s, plan = make(settings, "wfq", pools=(pool,))
    scripts = scripts_for(r)

    def rest(batch) -> tuple[int, int]:
        reply = scripts.run(_RawBatch(batch))
        return int(reply[0]), PickBatch.rest_wait_ms(reply)

    for _ in range(5):
        push(r, s, "normal", est=1000)
    assert rest(plan.batch(2)) == (2, 0)                   # took all it was asked for
    assert rest(plan.batch(3, general=1)) == (1, -1)       # the kept slots: no vip work
    assert rest(plan.batch(8)) == (2, -1)                  # the queue ran dry
    for _ in range(3):
        push(r, s, "batch", est=25_000)
    vip_expected(r, s)                                     # (the reserve held back)
    taken, wait_ms = rest(plan.batch(8))                   # the second waits for tokens
    assert taken == 1 and 0 < wait_ms <= 25_000


def test_a_large_message_is_not_copied_through_lua_but_fetched_by_tag(r, settings):
    from gateway_tasks.dispatch.router import INLINE_MESSAGE_MAX_B
    s, plan = make(settings, "wfq")
    small = push(r, s, "normal", tenant="a")
    queue = s.queue_name("normal", "default")
    tag = uuid.uuid4().hex
    big = {"body": "x" * (2 * INLINE_MESSAGE_MAX_B), "headers": {"gt_est_tokens": 10, "gt_tenant": "b"},
           "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": queue}}}
    assert enqueue(r, EnqueueCall(Keys(s.key_prefix), s.tier("normal"), "default", "b", tag, 10,
                                  json.dumps(big))).accepted
    got = scripts_for(r).run(plan.batch(2))
    by_tag = {g.tag: g for g in got}
    assert by_tag[small].payload["properties"]["delivery_tag"] == small   # inline
    assert by_tag[tag].payload is None and by_tag[tag].message_b > INLINE_MESSAGE_MAX_B
    fetched = plan.with_payload(r, by_tag[tag])
    assert fetched.payload["body"] == big["body"]
    assert dispatch_of(fetched).dispatched_ms == by_tag[tag].dispatched_ms


class _EnqueueWithoutSize:
    """enqueue.lua as a release before message sizes were kept in index entries ran it."""

    SCRIPT = "dispatch/enqueue"

    def __init__(self, call: EnqueueCall):
        self.script_keys, self.parse = call.script_keys, call.parse
        args = list(call.script_args)
        args[14] = ""                        # ARGV[15] message_b
        self.script_args = args


def test_an_entry_keeps_its_messages_size_and_one_queued_without_it_is_still_dispatched(r, settings):
    s, plan = make(settings, "wfq")
    keys = Keys(s.key_prefix)
    sized = push(r, s, "normal", tenant="a")
    [entry] = r.zrange(keys.index("default", "normal"), 0, -1)
    assert IndexEntry.decode(entry).message_b == r.hstrlen(keys.messages("default"), sized)
    tag = uuid.uuid4().hex                            # queued by an older release: six fields
    message = json.dumps({"body": "é" * 10, "headers": {"gt_est_tokens": 10, "gt_tenant": "b"},
                          "properties": {"delivery_tag": tag}}, ensure_ascii=False)
    r.hset(keys.messages("default"), tag, message)
    old = scripts_for(r).run(_EnqueueWithoutSize(EnqueueCall(keys, s.tier("normal"), "default", "b", tag,
                                                              10, message)))
    assert old.accepted and IndexEntry.decode(old.entry).message_b is None
    got = {g.tag: g for g in scripts_for(r).run(plan.batch(2))}
    assert set(got) == {sized, tag}
    assert got[tag].payload["body"] == "é" * 10 and got[tag].message_b == len(message.encode())
    assert got[sized].message_b == IndexEntry.decode(entry).message_b


def test_enqueue_writes_message_and_entry_together_and_a_full_queue_keeps_neither(r, settings):
    from redis.exceptions import ResponseError
    keys = Keys(settings.key_prefix)
    tier = settings.tier("batch").__class__(**{**settings.tier("batch").__dict__, "queue_max_len": 1})
    s = settings.with_(tiers=tuple(tier if t.name == "batch" else t for t in settings.tiers))
    first = EnqueueCall(keys, s.tier("batch"), "default", "a", "tag-1", 10, '{"m": 1}')
    assert enqueue(r, first).accepted
    full = enqueue(r, EnqueueCall(keys, s.tier("batch"), "default", "a", "tag-2", 10, '{"m": 2}'))
    assert not full.accepted and full.queue_length == 1
    assert r.hkeys(keys.messages("default")) == [b"tag-1"]      # the refused message taken back out
    # the script alone, its message never written: an error, nothing queued
    with pytest.raises(ResponseError, match="not in the messages hash"):
        scripts_for(r).run(EnqueueCall(keys, s.tier("normal"), "default", "a", "tag-3", 10, '{}'))
    assert r.zcard(keys.index("default", "normal")) == 0


def test_a_dispatch_knows_whether_it_still_holds_its_lease_before_the_upstream_call(r, settings):
    """The worker's pre-call read says whether the task's dispatched record is still this
    dispatch's (same token): not once it was released or restored and dispatched again."""
    from gateway_tasks.dispatch.release import ACK, ReleaseCall
    from workers.pipeline import before_call
    s, plan = make(settings, "wfq")
    keys = Keys(s.key_prefix)
    pool = s.pools[0]
    push(r, s, "vip", est=10, tenant="a")
    got = pick(r, plan)
    d = dispatch_of(got)
    assert d.tag == got.tag and d.dispatched_ms == got.dispatched_ms
    assert before_call(r, keys, s, pool, "t", got.tag, got.dispatched_ms).lease_held
    assert not before_call(r, keys, s, pool, "t", got.tag, got.dispatched_ms - 1).lease_held   # another dispatch's
    assert before_call(r, keys, s, pool, "t").lease_held          # no tag (not a gateway dispatch): no check
    assert scripts_for(r).run(ReleaseCall(keys, s, pool.name, got.tag, ACK)).released
    assert not before_call(r, keys, s, pool, "t", got.tag, got.dispatched_ms).lease_held   # gone


@pytest.mark.parametrize("record, token, held", [
    (b"vip|1700000000123|a|s1|t|10|1|1", 1700000000123, True),
    (b"vip|1700000000123|a|s1|t|10|1|1", "1700000000123", True),
    (b"vip|1700000000124|a|s1|t|10|1|1", 1700000000123, False),
    (None, 1700000000123, False),
    (b"garbage", 1700000000123, False),
])
def test_holds_lease(record, token, held):
    from workers.pipeline import holds_lease
    assert holds_lease(record, token) is held
