"""Deferral that keeps the work, against a real Redis: a deferred submit is accepted and
held (not queued, not refused), released when its retry time comes, its tier's off-peak
window opens or the level falls, cancellable, shown over REST (202 with ``deferred``), in
the status and the metrics; and through a storm with a real worker: deferred, later run,
lost per tier."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
from celery import states
from fastapi.testclient import TestClient

from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.errors import Deferred, TaskCancelled
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import LevelAction, Overload
from gateway_tasks.metrics.exporter import render
from gateway_tasks.overload.controller import OverloadController
from gateway_tasks.overload.status import deployment_status
from gateway_tasks.rest.app import create_app
from tests.test_overload import HELLO, force_level

TENANTS = [("acme", "vip"), ("pro1", "normal"), ("free1", "batch")]


def queued(r, keys, tier: str) -> int:
    return r.zcard(keys.index("default", tier))


def test_a_deferred_submit_is_held_and_released_when_the_level_falls(r, make_gateway):
    gw = make_gateway(TENANTS)
    keys, s = Keys(gw.settings.key_prefix), gw.settings
    force_level(r, s, 3, "pool default utilisation 0.97 > 0.95")
    before_ms = int(time.time() * 1000)
    held = {t: gw.submit(t, HELLO) for t in ("pro1", "free1")}
    vip = gw.submit("acme", HELLO)
    assert vip.deferral is None and queued(r, keys, "vip") == 1
    for handle in held.values():
        d = handle.deferral
        assert d is not None and (d.reason, d.retry_after_s, d.level) == ("capacity_pressure", 300.0, 3)
        assert before_ms + 300_000 <= d.until_ms <= int(time.time() * 1000) + 300_000
        assert "utilisation 0.97" in d.message and "held until" in d.message
        assert handle.status == states.PENDING
    assert queued(r, keys, "normal") == queued(r, keys, "batch") == 0          # held, not queued
    assert r.zcard(keys.deferred("default", "normal")) == r.zcard(keys.deferred("default", "batch")) == 1
    status = deployment_status(r, s)
    assert status["tiers"]["batch"]["held"] == 1 and status["tiers"]["batch"]["reason"] == "capacity_pressure"
    text = render(r, s).decode()
    assert 'gateway_deferred_held_tasks{tier="batch"} 1.0' in text
    assert 'gateway_deferred_tasks_total{pool="default",tier="normal"} 1.0' in text
    assert ('gateway_deferrals_by_reason_total{outcome="held",pool="default",reason="capacity_pressure",'
            'tier="batch"} 1.0') in text

    controller = OverloadController(r, s, app=gw.app)
    controller.release(3)                                   # still L3, not due: nothing moves
    assert queued(r, keys, "batch") == 0 and r.zcard(keys.deferred("default", "batch")) == 1
    controller.release(2, room={"default": 1.0})            # paced: one task's worth of room this tick
    assert queued(r, keys, "normal") + queued(r, keys, "batch") == 1
    controller.release(2, room={"default": 0.0}, early=True)   # no room: only what is due (nothing)
    assert queued(r, keys, "normal") + queued(r, keys, "batch") == 1
    controller.release(2)                                   # L2 executes both tiers: released
    assert queued(r, keys, "normal") == queued(r, keys, "batch") == 1
    assert r.zcard(keys.deferred("default", "normal")) == r.zcard(keys.deferred("default", "batch")) == 0
    assert not r.exists(keys.held(held["free1"].id))
    controller.release(0)                                   # exactly once
    assert queued(r, keys, "batch") == 1
    assert 'gateway_deferred_released_tasks_total{pool="default",tier="batch"} 1.0' in render(r, s).decode()


def test_a_deadline_before_the_retry_time_is_refused_not_held(r, make_gateway):
    """Holding a task whose deadline ends before its retry time could only end it as
    DeadlineExceeded: its caller hears at once, with the retry time."""
    gw = make_gateway(TENANTS)
    keys, s = Keys(gw.settings.key_prefix), gw.settings
    force_level(r, s, 3, "pool default utilisation 0.97 > 0.95")
    with pytest.raises(Deferred) as refused:
        gw.submit("free1", HELLO, deadline_s=30)
    assert (refused.value.retry_after_s, refused.value.reason) == (300.0, "capacity_pressure")
    held = gw.submit("free1", HELLO, deadline_s=3600)          # its deadline outlasts the hold
    assert held.deferral is not None and r.zcard(keys.deferred("default", "batch")) == 1


def test_released_at_its_retry_time_or_its_off_peak_window_while_the_level_holds(r, make_gateway, settings):
    hour = datetime.now(timezone.utc).hour
    now_window = f"{hour:02d}:00-{(hour + 1) % 24:02d}:00"     # the current hour (UTC)
    tiers = tuple(t.__class__(**{**t.__dict__, "off_peak": now_window}) if t.name == "normal" else t
                  for t in settings.tiers)
    s = settings.with_(tiers=tiers, overload=Overload(actions=(
        LevelAction(3, "batch", "defer", retry_after_s=1.0, reason="capacity_pressure"),)))
    gw = make_gateway(TENANTS, settings=s)
    keys = Keys(s.key_prefix)
    force_level(r, s, 3)
    batch, normal = gw.submit("free1", HELLO), gw.submit("pro1", HELLO)
    assert normal.deferral.until_ms <= int(time.time() * 1000)      # inside its window: at once
    controller = OverloadController(r, s, app=gw.app)
    controller.release(3)
    assert queued(r, keys, "normal") == 1
    if redis_now_ms(r) < batch.deferral.until_ms:          # (its retry time had not come at the release)
        assert queued(r, keys, "batch") == 0
    time.sleep(max(0.0, batch.deferral.until_ms / 1000 - time.time() + 0.05))
    controller.release(3)                                   # its retry time came, still L3
    assert queued(r, keys, "batch") == 1 and r.zcard(keys.deferred("default", "batch")) == 0


def test_a_held_deferral_can_be_cancelled(r, make_gateway):
    gw = make_gateway(TENANTS)
    keys = Keys(gw.settings.key_prefix)
    force_level(r, gw.settings, 4)
    handle = gw.submit("free1", HELLO)
    done = gw.cancel(handle.id, "free1")
    assert done.was == "deferred" and done.cancelled
    assert r.zcard(keys.deferred("default", "batch")) == 0 and not r.exists(keys.held(handle.id))
    with pytest.raises(TaskCancelled, match="held it deferred"):
        handle.get(timeout=5)
    OverloadController(r, gw.settings, app=gw.app).release(0)
    assert queued(r, keys, "batch") == 0                    # nothing comes back
    assert gw.cancel(handle.id).was == "already_cancelled"


def test_rest_answers_202_with_the_deferral_unless_refusal_is_asked(r, make_gateway):
    gw = make_gateway(TENANTS)
    key = gw.register_tenant("free2", "batch")
    auth = {"Authorization": f"Bearer {key}"}
    force_level(r, gw.settings, 4, "pool default upstream error rate 0.25 > 0.1")
    with TestClient(create_app(gw)) as client:
        resp = client.post("/v1/tasks", json={"messages": HELLO}, headers=auth)
        assert resp.status_code == 202, resp.text
        body = resp.json()
        d = body["deferred"]
        assert (d["reason"], d["retry_after_s"], d["level"]) == ("system_overload", 600.0, 4)
        assert d["deferred_until"].endswith("Z") and "error rate 0.25" in d["message"]
        view = client.get(body["status_url"], headers=auth).json()
        assert view["status"] == states.PENDING and view["deferred"]["deferred_until_ms"] == d["deferred_until_ms"]
        assert view["deferred"]["reason"] == "system_overload"
        cancel = client.delete(body["status_url"], headers=auth)
        assert cancel.status_code == 200 and cancel.json()["was"] == "deferred"
        refused = client.post("/v1/tasks", json={"messages": HELLO}, headers={**auth, "X-Gateway-On-Defer": "refuse"})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "600"
        assert refused.json()["error"]["reason"] == "system_overload"
        bad = client.post("/v1/tasks", json={"messages": HELLO}, headers={**auth, "X-Gateway-On-Defer": "later"})
        assert bad.status_code == 400 and "on_defer" in bad.json()["error"]["message"]
    assert r.zcard(Keys(gw.settings.key_prefix).deferred("default", "batch")) == 0


@pytest.mark.slow
def test_a_storm_deferred_at_l3_loses_nothing(r, settings, tmp_path):
    """A real worker, the level forced to L3: vip runs at once; batch (retry 1 s here) is
    released at its retry time while L3 holds; normal (300 s) when the level falls.  Every
    task runs exactly once: deferred, later run, lost per tier."""
    from devtools import processes
    from gateway_tasks.core.settings import Pool
    from gateway_tasks.producer.gateway import Gateway
    from gateway_tasks.simulator import SimConfig, SimulatorThread

    per_tier = 12
    with SimulatorThread(SimConfig(base_latency_ms=5)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini", "gpt-4o"),
                    tpm=600_000, rpm=6_000)
        s = settings.with_(pools=(pool,), overload=Overload(tick_s=0.2, window_s=1.0, hold_s=60.0, actions=(
            LevelAction(3, "batch", "defer", retry_after_s=1.0, reason="capacity_pressure"),)))
        gw = Gateway(s, client=r)
        tenants = {tier: [f"{tier}{i}" for i in range(4)] for tier in ("vip", "normal", "batch")}
        for tier, names in tenants.items():
            for name in names:
                gw.register_tenant(name, tier)
        worker = processes.worker(s, concurrency=4, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            force_level(r, s, 3, "a storm (forced by the test)")
            handles = {tier: [gw.submit(names[i % 4], HELLO, max_tokens=16) for i in range(per_tier)]
                       for tier, names in tenants.items()}
            deferred = {tier: sum(h.deferral is not None for h in hs) for tier, hs in handles.items()}
            for h in handles["vip"]:
                h.get(timeout=30)
            for h in handles["batch"]:                   # released at its retry time, L3 still
                h.get(timeout=30)
            assert all(h.status == states.PENDING for h in handles["normal"])
            assert r.zcard(Keys(s.key_prefix).deferred("default", "normal")) == per_tier
            force_level(r, s, 0, "the storm is over (forced by the test)")
            for h in handles["normal"]:
                h.get(timeout=30)
        finally:
            worker.stop()
    ran = {tier: sum(h.status == states.SUCCESS for h in hs) for tier, hs in handles.items()}
    lost = {tier: per_tier - ran[tier] for tier in handles}
    assert deferred == {"vip": 0, "normal": per_tier, "batch": per_tier}
    assert ran == {"vip": per_tier, "normal": per_tier, "batch": per_tier} and lost == {"vip": 0, "normal": 0, "batch": 0}
    stats = {k.decode(): int(v) for k, v in r.hgetall(Keys(s.key_prefix).stats("default")).items()}
    assert stats["deferred_released:batch"] == stats["deferred_released:normal"] == per_tier


def test_a_deferred_task_vip_work_comes_to_wait_on_is_released_and_boosted(r, make_gateway):
    """No priority inversion through a deferral: batch work submitted on behalf of a vip task
    (judged at vip) that depends on the tenant's own held batch task lends it vip, which the
    level does not defer -- released at once and boosted."""
    gw = make_gateway(TENANTS)
    keys = Keys(gw.settings.key_prefix)
    force_level(r, gw.settings, 3)
    parent = gw.submit("acme", HELLO)
    leaf = gw.submit("free1", HELLO)
    assert leaf.deferral is not None and queued(r, keys, "batch") == 0
    middle = gw.submit("free1", HELLO, depends_on=[leaf.id], on_behalf_of=parent.id)
    assert middle.deferral is None and r.exists(keys.held(middle.id))     # held on its dependency
    assert queued(r, keys, "batch") == 1 and r.zcard(keys.deferred("default", "batch")) == 0
    assert (r.hget(keys.fair("default"), "b:batch") or b"").startswith(b"vip>free1|")   # boosted: vip priority
