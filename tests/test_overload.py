"""The load-level controller against a real Redis (one decision for the deployment,
compare-and-set, hysteresis, history), and each level's actions at submit through the
Python API, the REST API (429 + Retry-After + JSON), `gateway status`, GET /v1/status and
the metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.errors import Deferred
from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.state import read_history, read_state
from gateway_tasks.core.settings import MAX_LEVEL, Overload
from gateway_tasks.core.stats import ACTUAL_TOKENS, COMPLETED, UPSTREAM_ERRORS, tier_field
from gateway_tasks.metrics.exporter import render
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app
from gateway_tasks.overload.controller import OverloadCommitCall, OverloadController
from gateway_tasks.core.scripts import scripts_for

FAST = Overload(tick_s=0.2, window_s=1.0, hold_s=1.0)
HELLO = [{"role": "user", "content": "hello there"}]


def force_level(r, settings, level: int, reason: str = "forced by the test") -> None:
    """Commit a decision at ``level`` through the controller's own script (the one writer),
    as if a signal had asked for it just now (so it holds for a hold time)."""
    keys = Keys(settings.key_prefix)
    for _ in range(50):     # a worker's controller may commit between the read and the write
        state = read_state(r, keys)
        now = redis_now_ms(r)
        seen = tuple(now if k <= level else None for k in range(1, MAX_LEVEL + 1))
        call = OverloadCommitCall(keys, state.version, 0, now, level, reason, {}, {"ts_ms": now}, 5, seen)
        if scripts_for(r).run(call)[0]:
            return
    raise AssertionError(f"could not force L{level}")


def wait_level(controller, level, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        d = controller.tick()
        if d.level == level:
            return d
        time.sleep(controller.settings.overload.tick_s)
    raise AssertionError(f"level never reached L{level}; last {d}")


@pytest.fixture
def fast(settings):
    return settings.with_(overload=FAST)


def test_one_decision_per_tick_however_many_workers(r, fast):
    a, b = OverloadController(r, fast), OverloadController(r, fast)
    first = a.tick()
    second = b.tick()          # same tick: refused, it reads the decision instead
    assert first.committed and not second.committed and second.level == first.level == 0
    state = read_state(r, Keys(fast.key_prefix))
    assert state.version == 1 and state.ts_ms > 0
    time.sleep(0.25)
    assert b.tick().committed


def test_utilisation_raises_the_level_at_once_and_it_falls_after_the_hold(r, fast):
    keys = Keys(fast.key_prefix)
    c = OverloadController(r, fast)
    c.tick()
    tpm = fast.pools[0].tpm
    time.sleep(0.3)
    r.hincrby(keys.stats("default"), tier_field(ACTUAL_TOKENS, "batch"), int(tpm))   # a minute's worth
    d = c.tick()
    assert d.committed and d.level == 3 and "utilisation" in d.reason, d
    assert d.signals.utilisation["default"] > 0.95
    # no more traffic: util falls to 0 after the window, the level after the hold
    down = wait_level(c, 0)
    assert down.level == 0
    history = read_history(r, keys)
    assert [(h["from"], h["to"]) for h in history] == [(0, 3), (3, 0)]
    assert "utilisation" in history[0]["reason"]
    assert read_state(r, keys).changes == 2
    assert b"gateway_overload_level_changes_total 2.0" in render(r, fast)


def test_queue_depth_and_error_rate_levels(r, fast):
    keys = Keys(fast.key_prefix)
    few = fast.with_(overload=Overload(tick_s=0.2, window_s=1.0, hold_s=1.0, queue_depth_threshold=5))
    c = OverloadController(r, few)
    r.zadd(keys.index("default", "batch"), {f"t|{i:016x}|tag{i}|1|0|1": 0 for i in range(6)})
    d = c.tick()
    assert d.level == 4 and "6 tasks queued > 5" in d.reason
    r.delete(keys.index("default", "batch"))
    other = fast.with_(key_prefix=fast.key_prefix + "e:")
    ke = Keys(other.key_prefix)
    ce = OverloadController(r, other)
    ce.tick()
    time.sleep(0.3)
    r.hincrby(ke.stats("default"), UPSTREAM_ERRORS, 30)
    r.hincrby(ke.stats("default"), tier_field(COMPLETED, "vip"), 70)
    d = ce.tick()
    assert d.level == 4 and "error rate 0.30" in d.reason
    for k in r.scan_iter(match=f"{other.key_prefix}*"):
        r.delete(k)


def test_an_old_queued_task_raises_the_level(r, fast):
    from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
    from gateway_tasks.overload.controller import oldest_waits

    keys = Keys(fast.key_prefix)
    now = redis_now_ms(r)
    for i, age_ms in enumerate((500, 4_000)):           # vip's max wait is 2 s
        enqueue(r, EnqueueCall(keys, fast.tier("vip"), "default", tenant=f"t{i}", tag=f"tag{i}",
                               est_tokens=10, message_json="{}", enqueued_ms=now - age_ms))
    ages = oldest_waits(r, keys, fast, now)
    assert 4_000 <= ages["vip"] < 5_000 and "batch" not in ages
    d = OverloadController(r, fast).tick()
    assert d.level == 3 and "vip's oldest queued task" in d.reason


def test_a_queue_holding_the_pools_next_window_raises_the_level(r, fast):
    """200 batch tasks of 200 tenants (more than the tick's sample of 64 entries) whose
    estimated tokens are 1.2 windows of the pool's TPM: L3 at the first tick, before
    anything was served; the same queue with the backlog signal off asks for nothing."""
    from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
    from gateway_tasks.overload.status import deployment_status, format_status

    pool = fast.pools[0]
    est = int(pool.tpm * FAST.window_s / 60 * 1.2 / 200) + 1

    def flood(settings, tenants: int) -> None:
        keys = Keys(settings.key_prefix)
        for i in range(200):
            enqueue(r, EnqueueCall(keys, settings.tier("batch"), pool.name, tenant=f"t{i % tenants}",
                                   tag=f"tag{i}", est_tokens=est, message_json="{}"))

    flood(fast, 200)
    d = OverloadController(r, fast).tick()
    assert d.level == 3 and f"pool {pool.name}'s queue holds" in d.reason, d.reason
    assert d.signals.backlog_s[pool.name] == pytest.approx(200 * est / pool.tpm * 60, rel=1e-3)
    text = format_status(deployment_status(r, fast))
    assert f"backlog (queued tokens, in seconds of the pool's TPM): {pool.name} " \
           f"{d.signals.backlog_s[pool.name]:.1f} s" in text, text
    off = fast.with_(key_prefix=fast.key_prefix + "off:",
                     overload=Overload(tick_s=0.2, window_s=1.0, hold_s=1.0, backlog_signal=False))
    flood(off, 200)
    assert OverloadController(r, off).tick().level == 0


def test_one_tenants_bulk_queue_behind_its_own_cap_is_not_overload(r, fast):
    """The same 200 tasks from one batch tenant (2 at a time): it can start 2 of them in the
    next window, so the pool is not committed -- the other tenants' work is not deferred."""
    from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue

    pool, keys = fast.pools[0], Keys(fast.key_prefix)
    est = int(pool.tpm * FAST.window_s / 60 * 1.2 / 200) + 1
    for i in range(200):
        enqueue(r, EnqueueCall(keys, fast.tier("batch"), pool.name, tenant="bulk", tag=f"tag{i}",
                               est_tokens=est, message_json="{}"))
    d = OverloadController(r, fast).tick()
    cap = fast.tier("batch").max_concurrency_per_tenant
    assert d.level == 0, d.reason
    assert d.signals.backlog_s[pool.name] == pytest.approx(cap * est / pool.tpm * 60, abs=0.01)   # 2 tasks


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("acme", "vip"), ("pro1", "normal"), ("free1", "batch")])


def test_each_level_at_submit(r, gw):
    """The design document's table at submit (free = batch, pro = normal, enterprise = vip);
    a deferral refused when the caller asks for a refusal (held otherwise: test_deferral.py)."""
    keys = Keys(gw.settings.key_prefix)
    h = gw.submit("pro1", HELLO, model="gpt-4o", max_tokens=4000)
    assert h.model == "gpt-4o"                                 # L0: as requested
    expected = {1: {"pro1": (4000, "gpt-4o"), "free1": (2048, "gpt-4o")},
                2: {"pro1": (2048, "gpt-4o"), "free1": (1024, "gpt-4o-mini")}}
    for level, tenants in expected.items():
        force_level(r, gw.settings, level)
        for tenant, (tokens, model) in tenants.items():
            req = gw.estimate(tenant, HELLO, model="gpt-4o", max_tokens=4000)
            assert (req.max_tokens, req.model) == (tokens, model), (level, tenant)
            changed = (tokens, model) != (4000, "gpt-4o")
            assert req.degradation == ({"level": level, "requested_max_tokens": 4000, "requested_model": "gpt-4o"}
                                       if changed else {})
        vip = gw.estimate("acme", HELLO, model="gpt-4o", max_tokens=4000)
        assert (vip.max_tokens, vip.model, vip.degradation) == (4000, "gpt-4o", {})
    force_level(r, gw.settings, 3)
    depth_before = r.zcard(keys.index("default", "batch"))
    for tenant in ("free1", "pro1"):                           # L3: both deferred, 300 s
        with pytest.raises(Deferred) as exc:
            gw.submit(tenant, HELLO, on_defer="refuse")
        assert (exc.value.retry_after_s, exc.value.level, exc.value.reason) == (300, 3, "capacity_pressure")
    assert r.zcard(keys.index("default", "batch")) == depth_before   # nothing enqueued, nothing held
    assert r.zcard(keys.deferred("default", "batch")) == 0
    force_level(r, gw.settings, 4)
    with pytest.raises(Deferred) as exc:
        gw.submit("pro1", HELLO, on_defer="refuse")
    assert (exc.value.retry_after_s, exc.value.reason) == (600, "system_overload")
    vip = gw.submit("acme", HELLO, max_tokens=4000)             # vip never deferred; capped at L4
    assert vip.deferral is None
    assert gw.estimate("acme", HELLO, max_tokens=4000).max_tokens == 2048


def test_fallback_map_then_the_pools_fallback_model_at_submit(r, settings):
    from gateway_tasks.core.settings import Pool

    big = Pool("big", base_url="http://127.0.0.1:9/v1", api_key="k", models=("m-large", "m-mid"),
               tpm=600_000, rpm=6_000, fallback_model="m-small")
    small = Pool("small", base_url="http://127.0.0.1:9/v1", api_key="k", models=("m-small",),
                 tpm=600_000, rpm=6_000)
    s = settings.with_(pools=(big, small), overload=Overload(fallback_models=(("m-large", "m-mid"),)))
    g = Gateway(s, client=r)
    g.register_tenant("free1", "batch")
    force_level(r, s, 2)                                              # L2: batch on the fallback model
    mapped = g.estimate("free1", HELLO, model="m-large", max_tokens=100)
    assert (mapped.model, mapped.pool) == ("m-mid", "big")            # the settings map first
    by_pool = g.estimate("free1", HELLO, model="m-mid", max_tokens=100)
    assert (by_pool.model, by_pool.pool) == ("m-small", "small")      # then the pool's fallback_model,
    handle = g.submit("free1", HELLO, model="m-mid", max_tokens=100)  # served by another pool
    assert handle.queue == "gt.batch.small" and handle.model == "m-small"
    g.app.close()


def test_rest_answers_429_with_retry_after_when_refusal_is_asked_and_status(r, gw):
    key = gw.register_tenant("free2", "batch")
    force_level(r, gw.settings, 4, "pool default upstream error rate 0.30 > 0.1")
    with TestClient(create_app(gw)) as client:
        resp = client.post("/v1/tasks", json={"messages": HELLO, "on_defer": "refuse"},
                           headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 429 and resp.headers["Retry-After"] == "600"
        err = resp.json()["error"]
        assert err["type"] == "Deferred" and err["retry_after_s"] == 600 and err["level"] == 4
        assert err["reason"] == "system_overload" and "error rate 0.30" in err["message"]
        chat = client.post("/v1/chat/completions", json={"messages": HELLO},
                           headers={"Authorization": f"Bearer {key}"})
        assert chat.status_code == 429 and chat.json()["error"]["type"] == "Deferred"
        assert chat.headers["Retry-After"] == "600"
        force_level(r, gw.settings, 3, "pool default utilisation 1.00 > 0.95")
        status = client.get("/v1/status", headers={"Authorization": f"Bearer {key}"})
        assert status.status_code == 200
        body = status.json()
        assert body["level"] == 3 and body["tiers"]["batch"]["deferred"] and not body["tiers"]["vip"]["deferred"]
        assert body["tiers"]["batch"]["reason"] == "capacity_pressure" and body["degradation"] == "design"
        assert body["tiers"]["normal"]["deferred"] and body["pools"]["default"]["circuit"] == "closed"
        assert body["history"][-1]["to"] == 3
        assert "sk-" not in status.text
        assert client.get("/v1/status").status_code == 401
    assert b"gateway_overload_level 3.0" in render(gw)


def test_gateway_status_command(r, gw, redis_url):
    force_level(r, gw.settings, 2, "pool default utilisation 0.90 > 0.85")
    env = dict(os.environ, REDIS_URL=redis_url, GATEWAY_KEY_PREFIX=gw.settings.key_prefix)
    for var in ("GATEWAY_CONFIG", "GATEWAY_SETTINGS_JSON", "GATEWAY_POOLS_JSON"):
        env.pop(var, None)
    text = subprocess.run([sys.executable, "-m", "gateway_tasks.cli", "status"], env=env, check=True,
                          capture_output=True, text=True).stdout
    assert "load level: L2" in text and "utilisation 0.90" in text and "fallback model" in text
    # GATEWAY_CONFIG unset: it says it runs on the built-in defaults, and their pool
    assert text.startswith("configuration: built-in defaults (GATEWAY_CONFIG is unset)\n"
                           "  pool default http://127.0.0.1:8099/v1\n"), text
    as_json = json.loads(subprocess.run([sys.executable, "-m", "gateway_tasks.cli", "status", "--json"], env=env,
                                        check=True, capture_output=True, text=True).stdout)
    assert as_json["level"] == 2
    assert as_json["configuration"] == {"source": "built-in defaults (GATEWAY_CONFIG is unset)",
                                        "pools": [{"name": "default", "base_url": "http://127.0.0.1:8099/v1"}]}


@pytest.mark.slow
def test_worker_records_what_each_level_changed(r, settings, tmp_path):
    from gateway_tasks.core.settings import Pool
    from devtools import processes
    from gateway_tasks.simulator import SimConfig, SimulatorThread

    with SimulatorThread(SimConfig(base_latency_ms=5)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini", "gpt-4o"),
                    tpm=600_000, rpm=6_000)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        gw.register_tenant("free1", "batch")
        queued_at_l0 = gw.submit("free1", HELLO, model="gpt-4o", max_tokens=4000)   # no worker yet
        force_level(r, s, 1)                   # the level rises while it waits: capped at dispatch
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            at_dispatch = queued_at_l0.get(timeout=30)
            force_level(r, s, 2)
            degraded = gw.submit("free1", HELLO, model="gpt-4o", max_tokens=4000).get(timeout=30)
            vip = gw.submit("acme", HELLO, model="gpt-4o", max_tokens=4000).get(timeout=30)
        finally:
            worker.stop()
    o = at_dispatch["overload"]
    assert o["level_at_submit"] == 0 and o["level_at_dispatch"] >= 1
    assert o["max_tokens"] == {"requested": 4000, "used": 2048, "capped": True}
    assert at_dispatch["tokens"]["completion"] <= 2048
    o = degraded["overload"]
    assert o["level_at_submit"] == 2 and o["max_tokens"]["used"] == 1024 and o["changed"]
    assert o["model"] == {"requested": "gpt-4o", "used": "gpt-4o-mini", "substituted": True}
    assert degraded["model"] == "gpt-4o-mini" and degraded["response"]["model"] == "gpt-4o-mini"
    assert not vip["overload"]["changed"] and vip["model"] == "gpt-4o"
    stats = {k.decode(): int(v) for k, v in r.hgetall(Keys(s.key_prefix).stats("default")).items()}
    assert stats["degraded:batch"] == 2 and "degraded:vip" not in stats
