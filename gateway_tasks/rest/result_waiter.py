"""Waking a synchronous request the moment its task's result is stored.

The result backend publishes every meta it stores on the result key's own channel
(``lua/core/result_store.lua``, as Celery's Redis backend does).  An API process keeps
one pub/sub connection: a request waiting for a task subscribes to that task's
channel, reads the stored meta once (the task may have finished before the
subscription took effect), then sleeps until a ready meta is published -- no polling,
so the answer leaves as soon as the worker has written it.

A lost pub/sub connection costs nothing but latency: the waiter reads the stored meta
again every ``RECHECK_S`` and on every error, so a request never waits past its task's
end by more than that.

On a Redis Cluster the reads go through a cluster client (each result key to its master)
and the pub/sub connection to one node (a PUBLISH reaches every node of a cluster): a
lost one is replaced by one to the next node (``core.redis_client.subscriber_urls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from typing import Any, Awaitable, Callable, Sequence

import redis
import redis.asyncio as aioredis
from celery import states

from gateway_tasks.core.redis_client import async_client, subscriber_urls

log = logging.getLogger(__name__)

RECHECK_S = 1.0             # a missed publish (a reconnecting pub/sub) is caught by this
SUBSCRIBED_WAIT_S = 1.0     # how long to wait for Redis to confirm a subscription
IDLE_CHANNEL = b"gateway:result-waiter"   # keeps the connection subscribed between requests


class ResultWaiter:
    """One per API process and event loop: ``await waiter.wait(task_id, timeout_s)``."""

    def __init__(self, client: Any, key_for_task: Callable[[str], bytes],
                 decode: Callable[[bytes], dict[str, Any]], subscriber_urls: Sequence[str] = ()):
        self._client = client
        # where the pub/sub connection goes, in turn after each loss ((): ``client``'s own)
        self._subscriber_urls = tuple(subscriber_urls)
        self._subscriber: aioredis.Redis | None = None
        self._subscribers_made = 0
        self._key_for_task = key_for_task
        self._decode = decode
        self._pubsub: Any = None
        self._reader: asyncio.Task | None = None
        self._waiters: dict[bytes, set[asyncio.Future]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self._start_lock = asyncio.Lock()

    @classmethod
    def for_backend(cls, backend: Any, redis_url: str) -> "ResultWaiter":
        """A waiter on the Redis at ``redis_url`` for ``backend``'s result keys (the
        gateway's result backend lives in the deployment's Redis)."""
        subscribers = subscriber_urls(redis_url)
        return cls(async_client(redis_url), backend.get_key_for_task, backend.decode_result,
                   subscribers if subscribers != [redis_url] else ())

    async def _ensure_reader(self) -> None:
        async with self._start_lock:
            if self._reader is not None and not self._reader.done():
                return
            self._pubsub = (await self._next_subscriber()).pubsub()
            await self._pubsub.subscribe(IDLE_CHANNEL)
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _next_subscriber(self) -> Any:
        """The client the pub/sub connection is made from: ``client``, or a client of the next
        subscriber URL (the previous one closed)."""
        if not self._subscriber_urls:
            return self._client
        if self._subscriber is not None:
            with contextlib.suppress(Exception):
                await self._subscriber.aclose()
        url = self._subscriber_urls[self._subscribers_made % len(self._subscriber_urls)]
        self._subscribers_made += 1
        self._subscriber = async_client(url)
        return self._subscriber

    async def _read(self) -> None:
        pubsub = self._pubsub
        while True:
            try:
                message = await pubsub.get_message(timeout=RECHECK_S)
            except (redis.RedisError, OSError) as exc:
                log.warning("result waiter: pub/sub connection lost (%s); waiting requests poll", exc)
                for futures in self._waiters.values():   # each waiter reads the stored meta again
                    for fut in futures:
                        if not fut.done():
                            fut.set_result(None)
                return
            if message is None:
                continue
            channel = message.get("channel")
            if message["type"] == "subscribe":
                event = self._confirmed.get(channel)
                if event is not None:
                    event.set()
            elif message["type"] == "message":
                self._deliver(channel, message["data"])

    def _deliver(self, channel: bytes, payload: bytes) -> None:
        futures = self._waiters.get(channel)
        if not futures:
            return
        try:
            meta = self._decode(payload)
        except Exception:   # a meta this process cannot decode: the waiter reads it itself
            meta = None
        if meta is not None and meta.get("status") not in states.READY_STATES:
            return
        for fut in futures:
            if not fut.done():
                fut.set_result(meta)

    async def _stored(self, key: bytes) -> dict[str, Any] | None:
        raw = await self._client.get(key)
        return self._decode(raw) if raw is not None else None

    async def wait(self, task_id: str, timeout_s: float,
                   gone: Callable[[], Awaitable[bool]] | None = None) -> dict[str, Any] | None:
        """The task's ready meta; None once ``timeout_s`` passed or ``gone()`` said the
        client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        key = self._key_for_task(task_id)
        fut: asyncio.Future = loop.create_future()
        first = key not in self._waiters
        self._waiters.setdefault(key, set()).add(fut)
        try:
            await self._subscribe(key, first)
            while True:
                meta = await self._stored(key)
                if meta is not None and meta.get("status") in states.READY_STATES:
                    return meta
                remaining = deadline - loop.time()
                if remaining <= 0 or (gone is not None and await gone()):
                    return None
                done, _ = await asyncio.wait({fut}, timeout=min(RECHECK_S, remaining))
                if done:
                    published = fut.result()
                    if published is not None:
                        return published
                    fut = loop.create_future()          # the connection was lost: read again
                    self._waiters.setdefault(key, set()).add(fut)
                    await self._subscribe(key, True)
        finally:
            await self._release(key, fut)

    async def _subscribe(self, key: bytes, first: bool) -> None:
        try:
            await self._ensure_reader()
            if not first:
                return
            event = self._confirmed.setdefault(key, asyncio.Event())
            await self._pubsub.subscribe(key)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), SUBSCRIBED_WAIT_S)
        except (redis.RedisError, OSError) as exc:   # the stored meta is read every RECHECK_S
            log.warning("result waiter: cannot subscribe (%s); polling", exc)

    async def _release(self, key: bytes, fut: asyncio.Future) -> None:
        futures = self._waiters.get(key, set())
        futures.discard(fut)
        for other in list(futures):
            if other.done():
                futures.discard(other)
        if futures:
            return
        self._waiters.pop(key, None)
        self._confirmed.pop(key, None)
        if self._pubsub is not None and self._reader is not None and not self._reader.done():
            with contextlib.suppress(redis.RedisError, OSError):
                await self._pubsub.unsubscribe(key)

    async def close(self) -> None:
        """Stop reading and close both connections."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
        with contextlib.suppress(Exception):
            await self._client.aclose()
        if self._subscriber is not None:
            with contextlib.suppress(Exception):
                await self._subscriber.aclose()


_waiters: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ResultWaiter]" = weakref.WeakKeyDictionary()


def waiter_for(backend: Any, redis_url: str) -> ResultWaiter:
    """The running event loop's waiter (one pub/sub connection per loop and process)."""
    loop = asyncio.get_running_loop()
    waiter = _waiters.get(loop)
    if waiter is None:
        waiter = _waiters[loop] = ResultWaiter.for_backend(backend, redis_url)
    return waiter
