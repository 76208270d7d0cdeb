"""The retry budget of each task by tier (max_retries 1 / 3 / 5 for batch / normal / vip),
on top of the tier-wide ratio; 429 requeues count against it.  Real worker, real
simulator upstream."""

from __future__ import annotations

import pytest

from gateway_tasks.core.errors import RetryBudgetExceeded
from gateway_tasks.core.settings import Pool
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from workers.pipeline import TASK_RETRIES_SPENT, task_may_retry

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("failures,max_retries,allowed", [
    (1, 0, False), (1, 1, True), (2, 1, False), (3, 3, True), (4, 3, False), (5, 5, True), (6, 5, False)])
def test_task_may_retry(failures, max_retries, allowed):
    assert task_may_retry(failures, max_retries) is allowed


def test_seed_retry_budgets(settings):
    assert [settings.tier(t).max_retries for t in ("batch", "normal", "vip")] == [1, 3, 5]


def deploy(settings, sim, r, tmp_path, *, rpm=6_000):
    pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=600_000, rpm=rpm)
    s = settings.with_(pools=(pool,))
    gw = Gateway(s, client=r)
    worker = processes.worker(s, concurrency=8, log_path=str(tmp_path / "w.log")).start()
    processes.wait_for_workers(gw.app, 1)
    return gw, worker


def test_each_tier_gets_its_retries_then_a_clear_error(settings, r, tmp_path):
    with SimulatorThread(SimConfig(fail_rate=1.0, base_latency_ms=1)) as sim:   # every call: 500
        gw, worker = deploy(settings, sim, r, tmp_path)
        try:
            for tenant, tier in (("b", "batch"), ("n", "normal"), ("v", "vip")):
                gw.register_tenant(tenant, tier)
            handles = [gw.submit(t, "hello", max_tokens=5) for t in ("b", "n", "v")]
            errors = []
            for h in handles:
                with pytest.raises(RetryBudgetExceeded) as info:
                    h.get(timeout=60)
                errors.append(info.value)
            calls = sim.stats()["requests_error"]
        finally:
            worker.stop()
    assert all(e.reason == TASK_RETRIES_SPENT and "retries" in str(e) for e in errors)
    assert calls == (1 + 1) + (3 + 1) + (5 + 1)      # max_retries + 1 attempts each, no more


def test_429_requeues_count_against_the_task_budget(settings, r, tmp_path):
    # the upstream takes one request per second; the pool claims 100 times that, so most
    # first attempts get 429: a batch task (1 retry) that meets two 429s fails, saying when
    with SimulatorThread(SimConfig(rpm=60, burst_s=1, base_latency_ms=1)) as sim:
        gw, worker = deploy(settings, sim, r, tmp_path)
        try:
            tenants = [f"bulk{i}" for i in range(3)]
            for t in tenants:
                gw.register_tenant(t, "batch")
            handles = [gw.submit(t, f"job {i}", max_tokens=5) for i in range(2) for t in tenants]
            outcomes = []
            for h in handles:
                try:
                    outcomes.append(h.get(timeout=60))
                except RetryBudgetExceeded as exc:
                    outcomes.append(exc)
            upstream = sim.stats()
        finally:
            worker.stop()
    failed = [o for o in outcomes if isinstance(o, RetryBudgetExceeded)]
    assert failed, outcomes
    assert all(e.reason == TASK_RETRIES_SPENT and e.retry_after_s and e.retry_after_s > 0 for e in failed)
    assert all("429" in str(e) for e in failed)
    # no task was tried more than twice
    assert upstream["requests_ok"] + upstream["requests_429"] <= 2 * len(handles)
    assert upstream["requests_ok"] == len(handles) - len(failed)
