"""Tail drop by eviction when a pool's shared queue capacity is full: a VIP arrival evicts
the newest queued batch task (whose result fails as Evicted, with a throttle reason and
retry_after_s); a pool full of VIP work fails the newest VIP fast; batch never takes VIP
space.  Real Redis; the last test runs a real worker to show an evicted task never runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.core.errors import Evicted, QueueFull
from gateway_tasks.dispatch.evict import EVICTED_BY_HIGHER_TIER, tiers_below
from gateway_tasks.dispatch.enqueue import POOL_FULL, throttle_retry_after_s
from gateway_tasks.core.keys import Keys
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app

CAPACITY = 4


def small_pool(settings, capacity=CAPACITY, **changes):
    return settings.with_(pools=(replace(settings.pools[0], queue_capacity=capacity, **changes),))


@pytest.fixture
def gw(make_gateway, settings):
    return make_gateway([("b1", "batch"), ("b2", "batch"), ("n1", "normal"), ("v1", "vip"), ("v2", "vip")],
                        settings=small_pool(settings))


def ids(gw: Gateway, tier: str) -> list[str]:
    return [m["headers"]["id"] for m in queued_messages(gw.r, Keys(gw.settings.key_prefix), "default", tier)]


def total(gw: Gateway) -> int:
    keys = Keys(gw.settings.key_prefix)
    return sum(gw.r.zcard(keys.index("default", t.name)) for t in gw.settings.tiers)


def test_tiers_below_and_retry_after(settings):
    assert [t.name for t in tiers_below(settings, "vip")] == ["batch", "normal"]
    assert [t.name for t in tiers_below(settings, "pro")] == ["batch"]
    assert tiers_below(settings, "batch") == []
    assert [throttle_retry_after_s(settings.tier(t)) for t in ("vip", "normal", "batch")] == [2.0, 30.0, 60.0]


def test_a_vip_arrival_evicts_the_newest_batch_task(gw):
    batch = [gw.submit(t, f"bulk {i}", max_tokens=5) for i, t in enumerate(["b1", "b2", "b1", "b2"])]
    newest = batch[-1]
    vip = gw.submit("v1", "urgent", max_tokens=5)
    assert total(gw) == CAPACITY
    assert ids(gw, "vip") == [vip.id] and newest.id not in ids(gw, "batch")
    assert sorted(ids(gw, "batch")) == sorted(h.id for h in batch[:-1])
    with pytest.raises(Evicted, match="evicted .* to make room for a vip request") as info:
        newest.get(timeout=5)
    assert info.value.reason == EVICTED_BY_HIGHER_TIER and info.value.retry_after_s == 60.0
    assert isinstance(info.value, QueueFull)          # a tail drop, as far as the caller is concerned
    assert int(gw.r.hget(Keys(gw.settings.key_prefix).stats("default"), "evicted:batch")) == 1
    # the next one evicts the next newest (b1's second task)
    gw.submit("v2", "urgent too", max_tokens=5)
    assert batch[2].id not in ids(gw, "batch") and len(ids(gw, "batch")) == 2


def test_batch_never_takes_vip_space_and_lower_tiers_go_first(gw):
    gw.submit("b1", "bulk", max_tokens=5)
    gw.submit("n1", "normal", max_tokens=5)
    gw.submit("v1", "vip 1", max_tokens=5)
    gw.submit("v1", "vip 2", max_tokens=5)
    with pytest.raises(QueueFull) as info:            # full: a batch arrival evicts nothing
        gw.submit("b2", "more bulk", max_tokens=5)
    assert info.value.reason == POOL_FULL and total(gw) == CAPACITY
    gw.submit("v2", "vip 3", max_tokens=5)            # evicts the batch task, not the normal one
    assert ids(gw, "batch") == [] and len(ids(gw, "normal")) == 1
    gw.submit("v2", "vip 4", max_tokens=5)            # then the normal one
    assert ids(gw, "normal") == [] and len(ids(gw, "vip")) == CAPACITY
    with pytest.raises(QueueFull, match="no lower-tier task") as info:
        gw.submit("v1", "vip 5", max_tokens=5)        # only VIP left: the newest VIP fails fast
    assert info.value.reason == POOL_FULL and info.value.retry_after_s == 2.0
    with pytest.raises(QueueFull):
        gw.submit("n1", "normal 2", max_tokens=5)     # normal cannot evict VIP either
    assert len(ids(gw, "vip")) == CAPACITY


def test_parallel_vip_arrivals_never_overfill_the_pool(settings, r):
    g = Gateway(small_pool(settings, capacity=20), client=r)
    for i in range(4):
        g.register_tenant(f"bulk{i}", "batch")
    g.register_tenant("v", "vip")
    batch = [g.submit(f"bulk{i % 4}", f"b {i}", max_tokens=5) for i in range(20)]

    def one(i: int) -> str:
        try:
            g.submit("v", f"vip {i}", max_tokens=5)
            return "ok"
        except QueueFull:
            return "full"
    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(one, range(30)))
    assert outcomes.count("ok") == 20 and outcomes.count("full") == 10
    assert total(g) == 20 and ids(g, "batch") == []
    evicted = 0
    for h in batch:
        with pytest.raises(Evicted):
            h.get(timeout=5)
        evicted += 1
    assert evicted == 20
    g.app.close()


def test_rest_shows_the_throttle_reason(gw):
    keys = {t: gw.register_tenant(t, tier) for t, tier in (("b1", "batch"), ("v1", "vip"))}
    with TestClient(create_app(gw)) as client:
        post = lambda t: client.post("/v1/tasks", json={"messages": [{"role": "user", "content": "x"}]},  # noqa: E731
                                     headers={"Authorization": f"Bearer {keys[t]}"})
        first = post("b1").json()["task_id"]
        for _ in range(CAPACITY - 1):
            assert post("v1").status_code == 202
        assert post("v1").status_code == 202           # evicts the batch task
        view = client.get(f"/v1/tasks/{first}", headers={"Authorization": f"Bearer {keys['b1']}"}).json()
        assert view["error"]["type"] == "Evicted" and view["error"]["reason"] == EVICTED_BY_HIGHER_TIER
        assert view["error"]["retry_after_s"] == 60.0
        res = post("v1")
        assert res.status_code == 429 and res.headers["Retry-After"] == "2"
        err = res.json()["error"]
        assert err["type"] == "QueueFull" and err["reason"] == POOL_FULL and err["retry_after_s"] == 2.0


@pytest.mark.slow
def test_an_evicted_task_never_reaches_the_upstream(settings, r, tmp_path):
    with SimulatorThread(SimConfig(base_latency_ms=5)) as sim:
        s = small_pool(settings, base_url=sim.base_url)
        g = Gateway(s, client=r)
        g.register_tenant("b1", "batch")
        g.register_tenant("v1", "vip")
        batch = [g.submit("b1", f"bulk {i}", max_tokens=5) for i in range(CAPACITY)]
        vip = [g.submit("v1", f"vip {i}", max_tokens=5) for i in range(2)]
        worker = processes.worker(s, concurrency=4, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(g.app, 1)
            done = [h.get(timeout=60) for h in vip + batch[:2]]
            for h in batch[2:]:
                with pytest.raises(Evicted):
                    h.get(timeout=5)
            upstream = sim.stats()["requests_ok"]
        finally:
            worker.stop()
            g.app.close()
    assert len(done) == 4 and upstream == 4
