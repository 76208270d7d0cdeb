"""Upgrading across the move of a pool's fair state into its state hash (2026-12-05):
lua/dispatch/fair_merge.lua carries the old '<pool>:fair' hash over, field by field, and a real
worker runs it before its first pick."""

from __future__ import annotations

import pytest

from gateway_tasks.dispatch.fair_merge import FairMerge
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Pool
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway


def _hash(r, key):
    return {k.decode(): v.decode() for k, v in r.hgetall(key).items()}


def test_merge_keeps_the_later_virtual_times_and_every_line(r, key_prefix):
    keys = Keys(key_prefix)
    old, state = keys.fair_before_merge("p"), keys.fair("p")
    assert old != state
    r.hset(old, mapping={"v": "500", "f:normal": "600", "tv:normal": "300", "b:vip": "normal>e1",
                         "d:normal": "200>e2\n900>e3", "dn:normal": "200", "odd": "x"})
    r.hset(state, mapping={"v": "10", "f:normal": "700", "d:normal": "100>e4\n200>e2", "dn:normal": "100",
                           "tokens": "5", "odd": "kept"})
    scripts = scripts_for(r)
    assert scripts.run(FairMerge(keys, "p")) == 7
    assert _hash(r, state) == {
        "v": "500",                      # the old virtual time was ahead: kept
        "f:normal": "700",               # the new finish tag was ahead: kept
        "tv:normal": "300",
        "b:vip": "normal>e1",
        "d:normal": "100>e4\n200>e2\n900>e3",   # both sets, once each, by urgent time
        "dn:normal": "100",
        "tokens": "5",                   # the bucket's own fields untouched
        "odd": "kept",                   # other fields: the state hash's value stands
    }
    assert not r.exists(old)
    assert scripts.run(FairMerge(keys, "p")) == 0      # nothing left to merge: a no-op
    assert _hash(r, state)["v"] == "500"


@pytest.mark.slow
def test_a_worker_carries_the_old_fair_hash_over_before_its_first_pick(settings, r, tmp_path):
    with SimulatorThread(SimConfig(tpm=120_000, rpm=6_000, base_latency_ms=5)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",),
                    tpm=120_000, rpm=6_000)
        s = settings.with_(pools=(pool,))
        keys = Keys(s.key_prefix)
        # a deployment upgraded from before 2026-12-05: its tier virtual time is far along
        r.hset(keys.fair_before_merge("default"), mapping={"v": "1000000", "f:vip": "1000000"})
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            result = gw.submit("acme", "hello", max_tokens=10).get(timeout=60)
        finally:
            worker.stop()
    assert result["tier"] == "vip"
    assert not r.exists(keys.fair_before_merge("default"))
    state = _hash(r, keys.fair("default"))
    # the pick went on from the carried-over virtual time, not from zero
    assert float(state["v"]) >= 1_000_000 and float(state["f:vip"]) > 1_000_000
    assert "carried 2 fair-queuing field(s) over" in (tmp_path / "w.log").read_text()
