"""Stale-drop: interactive work (VIP and normal) is stale after 15 s by default
(queue_ttl_s per tier; batch has none: batch work of any age is still useful); a task
dispatched past its tier's queue TTL fails as Expired without calling the upstream,
takes nothing from the pool's bucket, gives its tenant's TPM tokens back and is
counted (gateway_expired_tasks)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from gateway_tasks.core.errors import DeadlineExceeded, Expired
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool
from gateway_tasks.core.stats import EXPIRED, tier_field
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway


TENANT_TPM = 60


def test_seed_queue_ttls(settings):
    assert [settings.tier(t).queue_ttl_s for t in ("vip", "normal", "batch")] == [15.0, 15.0, 0.0]


@pytest.mark.slow
def test_a_stale_task_expires_without_calling_the_upstream(settings, r, tmp_path):
    with SimulatorThread(SimConfig(base_latency_ms=5)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=600_000, rpm=6_000)
        tiers = tuple(replace(t, queue_ttl_s=0.3) if t.name == "normal" else t for t in settings.tiers)
        s = settings.with_(pools=(pool,), tiers=tiers)
        gw = Gateway(s, client=r)
        # its own TPM quota refills 1 token/s: what the expired task gives back shows
        gw.register_tenant("acme", "normal", tpm=TENANT_TPM)
        stale = gw.submit("acme", "waits too long", max_tokens=5)
        taken = TENANT_TPM - float(r.hget(Keys(s.key_prefix).tenant_bucket("acme"), "tokens"))
        time.sleep(0.6)                                 # no worker yet
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            with pytest.raises(Expired, match="queue TTL of 0.3 s") as info:
                stale.get(timeout=30)
            tenant_tokens = float(r.hget(Keys(s.key_prefix).tenant_bucket("acme"), "tokens"))
            bucket_debited = float(r.hget(Keys(s.key_prefix).bucket("default"), "debited_tokens") or 0)
            fresh = gw.submit("acme", "on time", max_tokens=5).get(timeout=30)
            upstream = sim.stats()["requests_ok"]
        finally:
            worker.stop()
    assert isinstance(info.value, DeadlineExceeded) and info.value.reason == "queue_ttl"
    assert fresh["tier"] == "normal" and upstream == 1
    assert int(r.hget(Keys(s.key_prefix).stats("default"), tier_field(EXPIRED, "normal"))) == 1
    # its quota back: the tenant's TPM bucket full again (it held `taken` tokens less, and
    # refills 1 token/s), the pool's bucket never debited for it
    assert taken > 5 and tenant_tokens == TENANT_TPM and bucket_debited == 0


@pytest.mark.slow
def test_scheduled_work_never_goes_stale(settings, r, tmp_path):
    """The TTL drops interactive work nobody waits for any more; a cron run (the scheduled
    lane) that waited as long is still run."""
    with SimulatorThread(SimConfig(base_latency_ms=5)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=600_000, rpm=6_000)
        tiers = tuple(replace(t, queue_ttl_s=0.3) if t.name == "normal" else t for t in settings.tiers)
        s = settings.with_(pools=(pool,), tiers=tiers)
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "normal")
        interactive = gw.submit("acme", "waits too long", max_tokens=5)
        scheduled = gw.submit("acme", "a background run waits as long", max_tokens=5, lane="scheduled")
        time.sleep(0.6)                                 # no worker yet: both past the TTL
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            with pytest.raises(Expired):
                interactive.get(timeout=30)
            ran = scheduled.get(timeout=30)
        finally:
            worker.stop()
        upstream = sim.stats()["requests_ok"]
    assert ran["lane"] == "scheduled" and ran["timing"]["queue_wait_ms"] > 300 and upstream == 1
