"""The synchronous endpoint's wait for a result: woken by the result's publish, not by polling.

``RECHECK_S`` (the fallback read of the stored meta) is set far beyond each test's own
timeout, so a wait that returns a result can only have been woken by the publish -- or,
for a task that had finished before the wait began, by the one read after subscribing.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from celery import states

from gateway_tasks.rest import result_waiter
from gateway_tasks.rest.result_waiter import ResultWaiter


@pytest.fixture
def no_recheck(monkeypatch):
    monkeypatch.setattr(result_waiter, "RECHECK_S", 60.0)


def _run(gateway, coro_of):
    async def main():
        waiter = ResultWaiter.for_backend(gateway.app.backend, gateway.settings.redis_url)
        try:
            return await coro_of(waiter)
        finally:
            await waiter.close()
    return asyncio.run(main())


def test_a_publish_wakes_the_waiter(gateway, no_recheck):
    backend = gateway.app.backend
    task_id = "waiter-publish"

    async def wait(waiter):
        async def store_soon():
            await asyncio.sleep(0.3)                   # the waiter is subscribed by then
            await asyncio.to_thread(backend.store_result, task_id, {"ok": 1}, states.STARTED)
            await asyncio.to_thread(backend.store_result, task_id, {"answer": 42}, states.SUCCESS)
        storing = asyncio.create_task(store_soon())
        meta = await waiter.wait(task_id, 10.0)
        await storing
        return meta
    meta = _run(gateway, wait)
    assert meta is not None and meta["status"] == states.SUCCESS and meta["result"] == {"answer": 42}


def test_a_task_finished_before_the_wait_is_read_at_once(gateway, no_recheck):
    gateway.app.backend.store_result("waiter-done", {"answer": 7}, states.SUCCESS)
    meta = _run(gateway, lambda waiter: waiter.wait("waiter-done", 10.0))
    assert meta["result"] == {"answer": 7}


def test_waiters_of_one_task_all_wake_and_a_timeout_is_none(gateway, no_recheck):
    backend = gateway.app.backend

    async def wait(waiter):
        async def store_soon():
            await asyncio.sleep(0.3)
            await asyncio.to_thread(backend.store_result, "waiter-many", {"n": 3}, states.SUCCESS)
        storing = asyncio.create_task(store_soon())
        metas = await asyncio.gather(*(waiter.wait("waiter-many", 10.0) for _ in range(3)),
                                     waiter.wait("waiter-never", 0.5))
        await storing
        return metas
    *three, never = _run(gateway, wait)
    assert [m["result"] for m in three] == [{"n": 3}] * 3
    assert never is None


def test_the_waiter_serves_several_event_loops(gateway, no_recheck):
    """TestClient and uvicorn workers run their own loops: each gets its own waiter."""
    gateway.app.backend.store_result("waiter-loops", {"n": 1}, states.SUCCESS)
    seen = []

    def in_thread():
        async def main():
            waiter = result_waiter.waiter_for(gateway.app.backend, gateway.settings.redis_url)
            assert result_waiter.waiter_for(gateway.app.backend, gateway.settings.redis_url) is waiter
            try:
                return await waiter.wait("waiter-loops", 5.0)
            finally:
                await waiter.close()
        seen.append(asyncio.run(main())["result"])
    threads = [threading.Thread(target=in_thread) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [{"n": 1}, {"n": 1}]
