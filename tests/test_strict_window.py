"""A pool in front of a strict sliding-window upstream (Pool.window = "strict"), 429 recovery
at Retry-After, and a worker that waits for its bucket on the bells that can end the wait.

Real Redis and scripts throughout; the last test runs a real worker against the simulator's
strict mode (docs/rate-limits.md)."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import replace

import pytest

from devtools import processes
from devtools.bench.strict import window_figures
from devtools.quotas import for_load
from gateway_tasks.bucket.calls import DrainCall, SettleCall
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.dispatch.poll_step import ALL_BELLS, RESERVED_AND_OWN, RESERVED_AND_POOL, wait_bells
from gateway_tasks.dispatch.router import PickPlan, Picked, Wait, pick_now
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.simulator.bucket import SlidingWindow

URL = "http://127.0.0.1:1/v1"


def pool(name: str = "default", **kw) -> Pool:
    p = Pool(name, base_url=URL, api_key="x", models=("m",), **{"tpm": 60_000, "rpm": 10_000, **kw})
    p.validate()
    return p


# -- settings -----------------------------------------------------------------------------
def test_a_strict_pool_spends_at_most_its_quota_in_any_minute():
    tcap, trate, rcap, rrate = pool(window="strict", burst_s=2).rates()
    assert (tcap, rcap) == (2_000, 333.3333333333333)
    assert tcap + trate * 60_000 == pytest.approx(60_000)      # capacity + a minute of refill = the quota
    assert rcap + rrate * 60_000 == pytest.approx(10_000)
    assert pool().rates()[1] * 60_000 == 60_000               # "bucket": refilled at the quota


@pytest.mark.parametrize("kw,field", [
    ({"window": "sliding"}, "window"),
    ({"window": "strict"}, "burst_s"),                        # the default 60 s burst: refused
    ({"window": "strict", "burst_s": 1, "charge": "actual"}, "charge"),
    ({"reserve_hold_s": -1}, "reserve_hold_s"),
])
def test_bad_window_settings_fail_fast_by_name(kw, field):
    with pytest.raises(ConfigError, match=field):
        pool(**kw)


# -- the simulator's strict window ------------------------------------------------------------
def test_the_sliding_window_charges_at_admission_keeps_it_and_says_exactly_when_it_fits():
    now = [0.0]
    w = SlidingWindow(1_000, 60.0, clock=lambda: now[0])
    w.take(600)
    now[0] = 10.0
    w.take(300)
    w.give(300)                                   # a strict upstream gives nothing back
    assert w.remaining() == 100
    assert w.wait_s(100) == 0.0
    assert w.wait_s(200) == pytest.approx(50.0)   # the first charge expires at 60 s
    assert w.wait_s(800) == pytest.approx(60.0)   # ... and the second at 70 s
    now[0] = 60.0
    assert w.can_take(700) and not w.can_take(701)


def test_window_figures_count_requests_per_10_s_and_quota_after_the_first_minute():
    series = {"first_second": 100, "tokens": [1_000] * 80, "requests": [2] * 70 + [0] * 10}
    got = window_figures(series, 100, 80, 60_000, requests_429=1)
    assert got["requests_per_10s"] == [20] * 7 + [0]
    assert got["min_window_requests"] == 0
    assert got["quota_used_after_first_minute_pct"] == 100.0
    assert got["upstream_429_pct"] == pytest.approx(100 / 141, abs=1e-3)


# -- settle, drain, the reserve ------------------------------------------------------------------
def _settle(r, p: Pool, keys: Keys, est: int, actual: int, unsent: bool = False, empty: bool = True) -> float:
    """settle.lua on pool p's bucket (first emptied, with no refill before the call: empty)."""
    if empty:
        r.hset(keys.bucket(p.name), mapping={"tokens": 0, "requests": 10, "ts_ms": 2 * 10**13})
    return scripts_for(r).run(SettleCall(keys, p, tier="normal", tenant_id="t", model="m", est_tokens=est,
                                         actual_tokens=actual, completion_tokens=actual, learn_weight=0,
                                         give_back_request=unsent)).tokens


def test_a_strict_pool_keeps_the_unused_reserve_a_bucket_pool_gives_it_back(r, settings):
    keys = Keys(settings.key_prefix)
    strict, bucket = pool("s", window="strict", burst_s=1), pool("b", burst_s=1)
    assert _settle(r, strict, keys, est=500, actual=200) == 0                 # charged at admission: kept
    assert _settle(r, bucket, keys, est=500, actual=200) == 300               # given back
    assert _settle(r, strict, keys, est=500, actual=0, unsent=True) == 500    # never sent: all back
    assert _settle(r, strict, keys, est=100, actual=150) == -50               # more than estimated: charged
    r.hset(keys.bucket("s"), mapping={"tokens": 400, "ts_ms": 2 * 10**13})
    assert _settle(r, strict, keys, est=100, actual=150, empty=False) == 350


def _push(r, s, keys: Keys, tier: str, est: int) -> None:
    tag = uuid.uuid4().hex
    msg = {"body": "", "headers": {"gt_est_tokens": est, "gt_tenant": f"t-{tag[:6]}", "id": tag},
           "properties": {"delivery_tag": tag, "delivery_info": {"exchange": "", "routing_key": s.queue_name(tier, "default")}}}
    assert enqueue(r, EnqueueCall(keys, s.tier(tier), "default", f"t-{tag[:6]}", tag, est, json.dumps(msg))).accepted


def test_after_a_429_dispatch_resumes_at_retry_after_reserve_or_not(r, settings):
    """The refused request's tokens are there at Retry-After; with no vip work expected the
    reserve does not add 0.2 x burst_s of refill on top (the idle gap)."""
    p = pool(tpm=6_000, burst_s=60)    # capacity 6000, 100 tokens/s; vip reserve 20% = 1200
    s = settings.with_(pools=(p,))
    keys = Keys(s.key_prefix)
    plan = PickPlan(s, s.queue_names())
    scripts = scripts_for(r)
    _push(r, s, keys, "normal", est=500)
    blocked_until = scripts.run(DrainCall(keys, p, retry_after_ms=2_000, est_tokens=500))
    got = pick_now(scripts, plan)
    assert isinstance(got, Wait) and 0 < got.wait_ms <= 2_000           # Retry-After, not 2 s + 12 s
    r.hset(keys.bucket("default"), mapping={"blocked_until_ms": blocked_until - 2_000,
                                            "ts_ms": blocked_until - 2_000})   # as if 2 s passed
    assert isinstance(pick_now(scripts, plan), Picked)
    # vip work arrived lately: the reserve is held back from normal work again
    now_s, now_us = r.time()
    r.hset(keys.bucket("default"), mapping={"tokens": 6_000, "requests": 100, "ts_ms": now_s * 1000 + now_us // 1000})
    _push(r, s, keys, "vip", est=10)
    assert isinstance(pick_now(scripts, plan), Picked)                  # the vip task
    _push(r, s, keys, "normal", est=500)
    scripts.run(DrainCall(keys, p, retry_after_ms=0, est_tokens=500))
    got = pick_now(scripts, plan)
    assert isinstance(got, Wait) and got.wait_ms >= 10_000              # 1200 of reserve at 100/s


# -- the worker's wait ----------------------------------------------------------------------
@pytest.mark.parametrize("slot_limited,wait_ms,pools,expected", [
    (False, 120, 1, RESERVED_AND_POOL),   # waiting for the bucket: arrivals cannot go sooner
    (False, -1, 1, ALL_BELLS),            # nothing admissible known: any arrival may be
    (False, 0, 1, ALL_BELLS),
    (False, 120, 2, ALL_BELLS),           # which pool waits is not known: another's arrival may go
    (True, 120, 1, RESERVED_AND_OWN),     # only kept slots free
])
def test_a_wait_listens_to_the_bells_that_can_end_it(slot_limited, wait_ms, pools, expected):
    assert wait_bells(slot_limited, wait_ms, pools) == expected


def test_a_refund_rings_the_pool_bell_only_once_it_ends_the_wait(r, settings):
    keys = Keys(settings.key_prefix)
    p = pool(tpm=60_000, burst_s=60)                 # 1 token a ms
    now_s, now_us = r.time()
    now = now_s * 1000 + now_us // 1000
    r.hset(keys.bucket(p.name), mapping={"tokens": 0, "requests": 10, "ts_ms": now + 10**6,
                                         "wait_until_ms": now + 5_000})
    _settle(r, p, keys, est=3_000, actual=1_000, empty=False)   # 2000 back: the wait ends 2 s sooner, not now
    assert r.llen(keys.bell(p.name)) == 0
    assert float(r.hget(keys.bucket(p.name), "wait_until_ms")) == pytest.approx(now + 3_000)
    _settle(r, p, keys, est=4_000, actual=500, empty=False)     # 3500 more: it ends now
    assert r.llen(keys.bell(p.name)) == 1


# -- end to end: a worker against the simulator's strict window --------------------------------
@pytest.mark.slow
def test_a_strict_pool_keeps_a_strict_upstream_busy_within_its_quota(settings, r, tmp_path):
    """Offered 3x the quota for 12 s: the upstream admits a steady stream (no empty second
    after the first dispatch), charges no more than the pool's strict bound (capacity + the
    refill over the time; a pool refunding the unused half of max_tokens would send ~2x),
    nearly as much, and answers no 429."""
    tpm, max_tokens, seconds = 12_000, 40, 12
    with SimulatorThread(SimConfig(tpm=tpm, rpm=10_000, window="strict", base_latency_ms=20,
                                   completion_fraction=0.5)) as sim:
        p = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=tpm,
                 rpm=10_000, burst_s=1, window="strict")
        # the controller off: 3x the quota is an overload, and the design's L3 holds normal work
        # back (deferred), which is not what this measures
        s = for_load(settings.with_(pools=(p,), overload=replace(settings.overload, enabled=False)))
        gw = Gateway(s, client=r)
        for k in range(5):
            gw.register_tenant(f"t{k}", "normal")
        per_task = gw.estimate("t0", "item 0", max_tokens=max_tokens).est_tokens
        rate = 3 * tpm / 60 / per_task
        worker = processes.worker(s, concurrency=4, log_path=os.path.join(tmp_path, "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            sim.reset_stats()
            t0, i = time.monotonic(), 0
            while time.monotonic() - t0 < seconds:
                while i < int((time.monotonic() - t0) * rate) + 1:
                    gw.submit(f"t{i % 5}", f"item {i}", max_tokens=max_tokens)
                    i += 1
                time.sleep(0.02)
            stats = sim.stats()
        finally:
            worker.stop()
            gw.app.close()
    admitted = stats["admitted_per_s"]
    seconds_with = [k for k, n in enumerate(admitted["requests"]) if n > 0]
    assert seconds_with, "nothing reached the upstream"
    active = admitted["requests"][seconds_with[0]:len(admitted["requests"]) - 1]   # (the last second is partial)
    assert active and min(active) > 0, admitted["requests"]       # no empty second while work is queued
    elapsed_s = stats["now_monotonic"] - stats["started_monotonic"]
    charged = sum(admitted["tokens"])
    bound = p.rates()[0] + p.rates()[1] * 1000 * elapsed_s         # capacity + refill over the run
    assert charged <= bound + per_task, (charged, bound)
    assert charged >= 0.6 * bound, (charged, bound)
    assert stats["requests_429"] == 0
