"""The synchronous endpoint's wait for a result: woken by the result's publish, not by polling --
on the waiter's own reply channel (a task submitted naming it), or on the result key's channel.

``RECHECK_S`` (the fallback read of the stored meta) is set far beyond each test's own
timeout, so a wait that returns a result can only have been woken by the publish -- or,
for a task that had finished before the wait began, by the one read after subscribing.
"""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import redis
from celery import states

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.result_backend import REPLY_CHANNEL_HEADER

from gateway_tasks.rest import result_waiter
from gateway_tasks.rest.result_waiter import ResultWaiter


@pytest.fixture
def no_recheck(monkeypatch):
    monkeypatch.setattr(result_waiter, "RECHECK_S", 60.0)


def _run(gateway, coro_of):
    async def main():
        waiter = ResultWaiter.for_backend(gateway.app.backend, gateway.settings.redis_url,
                                          gateway.settings.key_prefix)
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


def _naming(channel: str) -> types.SimpleNamespace:
    """A task request whose message names a reply channel (as a worker's task request does)."""
    return types.SimpleNamespace(task=None, **{REPLY_CHANNEL_HEADER: channel})


def test_a_reply_channel_wakes_the_waiter_without_a_subscription_per_task(gateway, no_recheck):
    """A task submitted naming the waiter's reply channel: its final meta comes there; the
    waiter subscribes to nothing else and reads nothing first."""
    backend = gateway.app.backend
    task_id = "waiter-replied"
    listener = redis.Redis.from_url(gateway.settings.redis_url)

    async def wait(waiter):
        since = await waiter.listening()
        subscribed = []

        async def store_soon():
            await asyncio.sleep(0.3)
            subscribed.extend(c.decode() for c in await asyncio.to_thread(
                listener.pubsub_channels, f"{gateway.settings.key_prefix}*"))
            request = _naming(waiter.reply_channel)
            await asyncio.to_thread(backend.store_result, task_id, {"ok": 1}, states.STARTED, request=request)
            await asyncio.to_thread(backend.store_result, task_id, {"answer": 42}, states.SUCCESS,
                                    request=request)
        storing = asyncio.create_task(store_soon())
        meta = await waiter.wait(task_id, 10.0, since=since)
        await storing
        return meta, subscribed, waiter.reply_channel
    meta, subscribed, channel = _run(gateway, wait)
    listener.close()
    assert meta["status"] == states.SUCCESS and meta["result"] == {"answer": 42}
    assert subscribed == [channel]


def test_a_result_published_before_its_wait_began_is_kept_for_it(gateway, no_recheck):
    backend = gateway.app.backend

    async def wait(waiter):
        since = await waiter.listening()
        await asyncio.to_thread(backend.store_result, "waiter-early", {"n": 5}, states.SUCCESS,
                                request=_naming(waiter.reply_channel))
        await asyncio.sleep(0.3)     # the reader has it before anyone waits
        backend.client.delete(backend.get_key_for_task("waiter-early"))   # so no read could find it
        return await waiter.wait("waiter-early", 5.0, since=since)
    assert _run(gateway, wait)["result"] == {"n": 5}


def test_the_result_backend_publishes_only_final_states_to_the_reply_channel(gateway):
    backend = gateway.app.backend
    listener = redis.Redis.from_url(gateway.settings.redis_url).pubsub()
    channel = Keys(gateway.settings.key_prefix).reply_channel("test")
    listener.subscribe(channel)
    try:
        assert listener.get_message(timeout=2)["type"] == "subscribe"
        backend.store_result("reply-states", None, states.STARTED, request=_naming(channel))
        backend.store_result("reply-states", {"x": 1}, states.SUCCESS, request=_naming(channel))
        got = listener.get_message(timeout=2)
        assert listener.get_message(timeout=0.3) is None
    finally:
        listener.close()
    assert got["type"] == "message" and backend.decode_result(got["data"])["status"] == states.SUCCESS
