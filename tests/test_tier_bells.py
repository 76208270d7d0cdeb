"""Each tier's arrivals ring that tier's bell (``Keys.tier_bell``), so with per-tier
workers (deploy/k8s: gateway-worker-vip consumes only gt.vip.*) an arrival's wake-up
goes to a dispatcher that can pick it: before, a batch-only dispatcher could take a vip
arrival's token from the pool's one bell and the vip dispatcher slept until its poll
timeout (the storm bench's per-tier run: the VIP probe's quiet queue-wait p99 501 ms).
A release that puts a task back or unparks its tenant rings the task's tier's bell too."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

import redis

from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool, Settings
from gateway_tasks.dispatch.release import ACK, REQUEUE, ReleaseCall
from gateway_tasks.dispatch.router import PickPlan, Picked, pick_now

POOL = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",), tpm=10**9, rpm=10**9)


def push(r: redis.Redis, s: Settings, tier: str, tenant: str = "") -> str:
    tag = uuid.uuid4().hex
    tenant = tenant or f"{tier}-{tag[:6]}"
    msg = {"body": "", "headers": {"gt_est_tokens": 100, "gt_tenant": tenant, "id": tag},
           "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": "q"}}}
    assert enqueue(r, EnqueueCall(Keys(s.key_prefix), s.tier(tier), "default", tenant, tag, 100,
                                  json.dumps(msg))).accepted
    return tag


def test_a_dispatcher_waits_on_its_tiers_bells_and_its_pools(settings):
    s = settings.with_(pools=(POOL,))
    k = Keys(s.key_prefix)
    vip_only = PickPlan(s, [s.queue_name("vip", "default")])
    assert vip_only.bell_keys == [k.tier_bell("default", "vip"), k.bell("default")]
    mixed = PickPlan(s, s.queue_names())
    assert mixed.bell_keys == [*(k.tier_bell("default", t) for t in ("vip", "normal", "batch")), k.bell("default")]
    # every key one dispatcher waits on shares the pool's hash tag (one slot on Redis Cluster)
    assert {key.split("}")[0] for key in mixed.bell_keys} == {k.bell("default").split("}")[0]}


def test_an_arrival_wakes_only_a_dispatcher_that_serves_its_tier(r, settings):
    s = settings.with_(pools=(POOL,))
    batch_only = PickPlan(s, [s.queue_name("batch", "default")])
    vip_only = PickPlan(s, [s.queue_name("vip", "default")])
    push(r, s, "vip")
    assert r.blpop(batch_only.bell_keys, timeout=0.05) is None       # not the batch worker's token
    woke = r.blpop(vip_only.bell_keys, timeout=0.05)
    assert woke is not None and woke[0].decode() == Keys(s.key_prefix).tier_bell("default", "vip")
    push(r, s, "batch")
    assert r.blpop(vip_only.bell_keys, timeout=0.05) is None
    assert r.blpop(batch_only.bell_keys, timeout=0.05) is not None


def test_a_mixed_dispatcher_wakes_for_any_tier_and_for_the_pool_bell(r, settings):
    s = settings.with_(pools=(POOL,))
    k = Keys(s.key_prefix)
    mixed = PickPlan(s, s.queue_names())
    push(r, s, "normal")
    assert r.blpop(mixed.bell_keys, timeout=0.05)[0].decode() == k.tier_bell("default", "normal")
    r.lpush(k.bell("default"), "1")                                  # a refund or a freed slot
    assert r.blpop(mixed.bell_keys, timeout=0.05)[0].decode() == k.bell("default")
    assert r.blpop(mixed.bell_keys, timeout=0.05) is None


def rung(r: redis.Redis, s: Settings) -> dict[str, int]:
    """Tokens on each of the pool's bells, by the name a dispatcher's wait would report."""
    k = Keys(s.key_prefix)
    bells = {t: k.tier_bell("default", t) for t in ("vip", "normal", "batch")} | {"pool": k.bell("default")}
    return {name: r.llen(key) for name, key in bells.items() if r.llen(key)}


def silence(r: redis.Redis, s: Settings) -> None:
    k = Keys(s.key_prefix)
    r.delete(*(k.tier_bell("default", t) for t in ("vip", "normal", "batch")), k.bell("default"))


def test_a_task_put_back_rings_its_tiers_bell_not_the_pools(r, settings):
    s = settings.with_(pools=(POOL,))
    vip_only = PickPlan(s, [s.queue_name("vip", "default")])
    tag = push(r, s, "vip")
    got = pick_now(scripts_for(r), vip_only)
    assert isinstance(got, Picked) and got.tag == tag
    silence(r, s)
    assert scripts_for(r).run(ReleaseCall(vip_only.keys, s, "default", tag, REQUEUE)).released   # e.g. a 429
    assert rung(r, s) == {"vip": 1}
    # a batch-only dispatcher's wait does not take it; the vip one's does
    assert r.blpop(PickPlan(s, [s.queue_name("batch", "default")]).bell_keys, timeout=0.05) is None
    assert r.blpop(vip_only.bell_keys, timeout=0.05) is not None


def test_a_tenant_unparked_by_an_ack_rings_its_tiers_bell_and_a_plain_ack_rings_none(r, settings):
    s = settings.with_(pools=(POOL,))
    s = s.with_(tiers=tuple(replace(t, max_concurrency_per_tenant=1) if t.name == "normal" else t for t in s.tiers))
    plan = PickPlan(s, s.queue_names())
    first = push(r, s, "normal", "acme")
    push(r, s, "normal", "acme")                             # acme's second, held by its cap
    lone = push(r, s, "batch")
    picked = [pick_now(scripts_for(r), plan) for _ in range(3)]
    assert [p.tag for p in picked if isinstance(p, Picked)] == [first, lone]   # acme parked at its cap
    silence(r, s)
    assert scripts_for(r).run(ReleaseCall(plan.keys, s, "default", lone, ACK)).released
    assert rung(r, s) == {}                                  # nobody waited on that slot
    assert scripts_for(r).run(ReleaseCall(plan.keys, s, "default", first, ACK)).released
    assert rung(r, s) == {"normal": 1}                       # acme's second task is dispatchable
