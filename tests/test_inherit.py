"""Transitive priority inheritance, on_behalf_of, and depends_on isolation between tenants:

* the tier a task waits at flows down its whole chain of dependencies -- held ones boosted
  once released -- and backs off when the waiter is gone;
* work submitted on behalf of a higher tier's live task is admitted and judged at that tier
  (controller on: the level read from its state), charged to its own tenant;
* a task a higher tier's task waits on is never evicted while that task lives;
* depends_on names only the tenant's own tasks (or ones shared with it through on_behalf_of):
  another tenant's id answers exactly like an unknown one; a task cannot wait on itself.

Real Redis; the last test runs real workers against the simulator with the load controller on."""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from devtools import processes
from gateway_tasks.core.errors import Deferred, InvalidRequest, QueueFull, UnknownTask
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.lifecycle import depends, inherit
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.producer.submission import IDEMPOTENCY_NAMESPACE
from gateway_tasks.rest.app import create_app
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.tenants.quota import hour_of
from gateway_tasks.core.clock import redis_now_ms


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("bulk", "batch"), ("acme", "vip"), ("other", "vip")])


def boosts(gw: Gateway, tier: str = "batch") -> dict[str, str]:
    """Queued task id -> the tier it is boosted at (the pool's 'b:<tier>' lines)."""
    raw = (gw.r.hget(gw.keys.fair("default"), f"b:{tier}") or b"").decode()
    by_tag = {m["properties"]["delivery_tag"]: m["headers"]["id"]
              for m in queued_messages(gw.r, Keys(gw.settings.key_prefix), "default", tier)}
    out = {}
    for line in filter(None, raw.split("\n")):
        lent, entry = line.split(">", 1)
        out[by_tag.get(entry.split("|")[2], "?")] = lent
    return out


def finish(gw: Gateway, task_id: str, ok: bool = True) -> int:
    return depends.finish(gw.app, gw.r, gw.keys, gw.settings.result_ttl_s, task_id, ok)


def test_a_tier_flows_down_the_chain_to_tasks_released_later_and_backs_off(gw):
    parent = gw.submit("acme", "the agent's request", max_tokens=5)
    a = gw.submit("bulk", "leaf", max_tokens=5)
    m = gw.submit("bulk", "middle, for the agent", max_tokens=5, depends_on=[a.id], on_behalf_of=parent.id)
    assert boosts(gw) == {a.id: "vip"}                 # the parent lends down m's chain
    gw.cancel(parent.id)
    assert boosts(gw) == {}                            # ... and takes it back when it ends
    v = gw.submit("acme", "needs the middle", max_tokens=5, depends_on=[m.id])   # shared with acme
    assert boosts(gw) == {a.id: "vip"}                 # two hops down
    assert finish(gw, a.id) == 1                       # m released: queued, boosted at once
    assert boosts(gw)[m.id] == "vip"                   # (a's line goes with its dispatch)
    gw.cancel(v.id)                                    # the waiter is gone: no boost left
    assert m.id not in boosts(gw) and not gw.r.exists(gw.keys.lifted(v.id))


def test_a_cycle_down_the_chain_is_found(gw):
    scripts = scripts_for(gw.r)
    for task, dep in (("t1", "t2"), ("t2", "t3"), ("t3", "t1")):
        scripts.run(depends.DependCall(gw.keys, task, (dep,), "{}", 60_000, "batch"))
    chain = inherit.walk(gw.r, gw.keys, ["default"], "t1", ["t2"])
    assert chain.cycle and [n.task_id for n in chain.nodes] == ["t2", "t3", "t1"]
    assert not inherit.walk(gw.r, gw.keys, ["default"], "t9", ["t2"]).cycle


def test_depends_on_names_only_the_tenants_own_tasks(gw):
    mine = gw.submit("acme", "mine", max_tokens=5)
    theirs = gw.submit("other", "theirs", max_tokens=5)
    gw.submit("acme", "after mine", max_tokens=5, depends_on=[mine.id])
    errors = []
    for dep in (theirs.id, "00000000-0000-4000-8000-000000000000"):
        with pytest.raises(UnknownTask) as info:
            gw.submit("acme", "x", max_tokens=5, depends_on=[dep])
        errors.append(str(info.value).replace(dep, "<id>"))
    assert errors[0] == errors[1] == "depends_on names unknown tasks: ['<id>']"
    finish(gw, theirs.id, ok=False)                    # how it ended is not told either
    with pytest.raises(UnknownTask, match="unknown tasks"):
        gw.submit("acme", "x", max_tokens=5, depends_on=[theirs.id])
    with pytest.raises(InvalidRequest, match="itself"):   # its own idempotency id
        gw.submit("acme", "x", max_tokens=5, idempotency_key="k1",
                  depends_on=[gw.submit("acme", "y", max_tokens=5, idempotency_key="k1").id])
    before = int(gw.r.get(gw.keys.quota("acme", hour_of(redis_now_ms(gw.r)))) or 0)
    own = str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, "acme:k2"))
    gw.r.set(gw.keys.task_owner(own), gw.tenants.get("acme").owner_tag)   # its id, known before its submit
    with pytest.raises(InvalidRequest, match="itself"):
        gw.submit("acme", "x", max_tokens=5, idempotency_key="k2", depends_on=[own])
    assert int(gw.r.get(gw.keys.quota("acme", hour_of(redis_now_ms(gw.r)))) or 0) == before


def test_rest_another_tenants_id_answers_like_an_unknown_one(gw):
    key = gw.register_tenant("acme", "vip")
    theirs = gw.submit("other", "theirs", max_tokens=5)
    with TestClient(create_app(gw)) as client:
        def post(body):
            return client.post("/v1/tasks", json={"messages": [{"role": "user", "content": "x"}], **body},
                               headers={"Authorization": f"Bearer {key}"})
        answers = []
        for dep in (theirs.id, "00000000-0000-4000-8000-000000000000"):
            res = post({"depends_on": [dep]})
            answers.append((res.status_code, re.sub(re.escape(dep), "<id>", res.text)))
        assert answers[0] == answers[1] and answers[0][0] == 404
        parent = post({}).json()["task_id"]
        res = post({"on_behalf_of": parent, "depends_on": [parent]})
        assert res.status_code == 202
        assert post({"on_behalf_of": "no-such-task"}).status_code == 404


def test_on_behalf_of_is_judged_at_the_higher_tier_and_charged_to_its_own_tenant(gw):
    assert gw.settings.overload.enabled
    gw.r.hset(gw.keys.overload_state, mapping={"level": 3, "reason": "test: pool saturated"})
    parent = gw.submit("acme", "the agent's request", max_tokens=5)
    with pytest.raises(Deferred):
        gw.submit("bulk", "plain batch work", max_tokens=5000, on_defer="refuse")
    assert gw.submit("bulk", "plain batch work", max_tokens=5).deferral is not None   # held instead
    hour = hour_of(redis_now_ms(gw.r))
    counts = lambda: [int(gw.r.get(gw.keys.quota(t, hour)) or 0) for t in ("bulk", "acme")]  # noqa: E731
    before = counts()
    sub = gw.submit("bulk", "a sub-task for it", max_tokens=5000, on_behalf_of=parent.id)
    assert counts() == [before[0] + 1, before[1]]      # its own tenant's quota
    message = next(m for m in queued_messages(gw.r, gw.keys, "default", "batch") if m["headers"]["id"] == sub.id)
    req = json.loads(base64.b64decode(message["body"]))[0][0]
    assert req["effective_tier"] == "vip" and req["max_tokens"] == 5000 and req["degradation"] == {}
    assert sub.tier == "batch" and boosts(gw) == {sub.id: "vip"}   # dispatched at vip priority
    gw.app.backend.store_result(parent.id, None, "STARTED")   # running: still live
    gw.submit("bulk", "another, while it runs", max_tokens=5, on_behalf_of=parent.id)
    gw.cancel(parent.id)                               # the parent ended: plain batch work again
    assert boosts(gw) == {}
    with pytest.raises(UnknownTask, match="no live task"):
        gw.submit("bulk", "too late", max_tokens=5, on_behalf_of=parent.id)


def test_a_task_a_vip_task_waits_on_is_never_evicted(make_gateway, settings):
    g = make_gateway([("bulk", "batch"), ("acme", "vip")],
                     settings=settings.with_(pools=(replace(settings.pools[0], queue_capacity=4),)))
    parent = g.submit("acme", "the agent's request", max_tokens=5)
    needed = g.submit("bulk", "needed", max_tokens=5, on_behalf_of=parent.id)
    spare = [g.submit("bulk", f"spare {i}", max_tokens=5) for i in range(2)]
    g.cancel(parent.id)                                # room for one more; `needed` unprotected now
    waiter = g.submit("acme", "waits on it", max_tokens=5, depends_on=[needed.id])   # protected again
    arrivals = [g.submit("acme", f"urgent {i}", max_tokens=5) for i in range(3)]     # evict both spares
    with pytest.raises(QueueFull):
        g.submit("acme", "one too many", max_tokens=5)   # only `needed` is left below vip
    queued = [m["headers"]["id"] for m in queued_messages(g.r, g.keys, "default", "batch")]
    assert queued == [needed.id] and all(s.status == "FAILURE" for s in spare)
    assert waiter.status == "PENDING" and len(arrivals) == 3


@pytest.mark.slow
def test_a_vip_task_two_hops_above_a_flooded_batch_task_finishes_ahead_of_the_flood(settings, r, tmp_path):
    """V (vip) depends on M (batch, held), which depends on A (batch, queued behind its own
    tenant's share of a 300-task flood from 20 tenants).  With the load controller on, A jumps
    the flood (dispatched before the tasks its tenant queued ahead of it), M follows once
    released, and V completes while most of the flood is still queued."""
    from devtools.quotas import for_load

    with SimulatorThread(SimConfig(tpm=60_000, rpm=6_000, burst_s=2, base_latency_ms=20)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",),
                    tpm=60_000, rpm=6_000, burst_s=2)
        s = for_load(settings.with_(pools=(pool,)))
        assert s.overload.enabled
        g = Gateway(s, client=r)
        tenants = [f"bulk{i}" for i in range(20)]
        for t in tenants:
            g.register_tenant(t, "batch")
        g.register_tenant("acme", "vip")
        flood = [g.submit(tenants[i % 20], f"flood {i}", max_tokens=60) for i in range(300)]
        parent = g.submit("acme", "the agent's request", max_tokens=5)
        a = g.submit("bulk1", "leaf", max_tokens=60)
        m = g.submit("bulk1", "middle", max_tokens=60, depends_on=[a.id], on_behalf_of=parent.id)
        g.cancel(parent.id)                            # only the sharing stays: nothing is lent now
        worker = processes.worker(s, concurrency=8, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(g.app, 1)
            flood[20].get(timeout=60)                  # the flood is flowing
            submitted_ms = int(time.time() * 1000)
            v = g.submit("acme", "needs the middle", max_tokens=20, depends_on=[m.id])
            done_v = v.get(timeout=60)
            done_a = a.get(timeout=5)
            still_queued = sum(1 for h in flood if h.status == "PENDING")
            ahead = [h.get(timeout=120) for h in flood if h.tenant_id == "bulk1"]
        finally:
            worker.stop()
            g.app.close()
    chain_ms = done_v["timing"]["completed_ms"] - submitted_ms
    print(f"chain V->M->A {chain_ms} ms; A waited {done_a['timing']['queue_wait_ms']} ms; "
          f"{still_queued} of 300 flood tasks still queued when V completed")
    assert done_a["timing"]["dispatched_ms"] < max(h["timing"]["dispatched_ms"] for h in ahead)
    assert still_queued > 150


def test_bench_inherit_reports_the_spread_against_its_target():
    from devtools.bench.inherit import TARGET_CHAIN_MS, format_report, spread
    from devtools.cli import build_parser

    runs = [{"chain_ms": c, "control_ms": 12_000, "ratio": c / 12_000, "flood_queued_at_v": 250} for c in (160, 250, 240)]
    result = {"spec": {"runs": 3, "flood": 300, "tpm": 60_000}, "chain_ms": spread([r["chain_ms"] for r in runs]),
              "control_ms": spread([r["control_ms"] for r in runs]), "ratio": spread([r["ratio"] for r in runs]),
              "flood_queued_at_v": spread([r["flood_queued_at_v"] for r in runs]),
              "target_chain_ms": TARGET_CHAIN_MS, "all_targets_pass": True}
    text = format_report(result)
    assert "160 / 240 / 250 ms" in text and "PASS" in text and "12000 / 12000 / 12000 ms" in text
    args = build_parser().parse_args(["bench-inherit", "--runs", "2", "--check"])
    assert args.runs == 2 and args.check
