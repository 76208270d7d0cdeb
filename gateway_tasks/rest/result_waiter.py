"""Waking a synchronous request the moment its task's result is stored.

An API process keeps one pub/sub connection, subscribed to a reply channel of its own
(``Keys.reply_channel``).  A synchronous request asks for it first
(``listening``), submits its task naming it (the message header ``REPLY_CHANNEL_HEADER``),
then waits: the worker's result write (``lua/core/result_store.lua``) publishes the task's
final meta there as well as on the result key's own channel, and the reader hands it to the
request waiting for that task id -- no subscription, read or unsubscription per request.
A result published before its request began to wait is kept for it (``EARLY_MAX``).

A task that may not name this process's channel (an idempotency key's repeat returns the
first submit's task) is waited for on the result key's own channel instead: a subscription
for it, then one read of the stored meta (it may have finished before the subscription took
effect).  A result some other process writes without the header (a cancel, an eviction, a
dead letter) is read by the fallback below.

A lost pub/sub connection costs nothing but latency: the waiter reads the stored meta
again every ``RECHECK_S`` and on every error, so a request never waits past its task's
end by more than that; a request that began to listen on a connection since lost reads the
stored meta at once.

On a Redis Cluster the reads go through a cluster client (each result key to its master)
and the pub/sub connection to one node (a PUBLISH reaches every node of a cluster): a
lost one is replaced by one to the next node (``core.redis_client.subscriber_urls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Sequence

import redis
import redis.asyncio as aioredis
from celery import states

from gateway_tasks.core.redis_client import async_client, subscriber_urls
from gateway_tasks.core.keys import Keys

log = logging.getLogger(__name__)

RECHECK_S = 1.0             # a missed publish (a reconnecting pub/sub) is caught by this
SUBSCRIBED_WAIT_S = 1.0     # how long to wait for Redis to confirm a subscription
EARLY_MAX = 1024            # results kept that arrived before their request began to wait


class ResultWaiter:
    """One per API process and event loop: ``await waiter.wait(task_id, timeout_s)``."""

    def __init__(self, client: Any, key_for_task: Callable[[str], bytes],
                 decode: Callable[[bytes], dict[str, Any]], subscriber_urls: Sequence[str] = (),
                 key_prefix: str = ""):
        self._client = client
        # where the pub/sub connection goes, in turn after each loss ((): ``client``'s own)
        self._subscriber_urls = tuple(subscriber_urls)
        self._subscriber: aioredis.Redis | None = None
        self._subscribers_made = 0
        self._key_for_task = key_for_task
        self._decode = decode
        self.reply_channel = Keys(key_prefix).reply_channel(uuid.uuid4().hex)
        self._reply = self.reply_channel.encode()
        self._pubsub: Any = None
        self._reader: asyncio.Task | None = None
        self._generation = 0     # pub/sub connections opened so far (the one listening now)
        self._waiters: dict[bytes, set[asyncio.Future]] = {}   # result key -> its waiting requests
        self._confirmed: dict[bytes, asyncio.Event] = {}
        self._early: OrderedDict[bytes, dict[str, Any]] = OrderedDict()
        self._start_lock = asyncio.Lock()

    @classmethod
    def for_backend(cls, backend: Any, redis_url: str, key_prefix: str = "") -> "ResultWaiter":
        """A waiter on the Redis at ``redis_url`` for ``backend``'s result keys (the
        gateway's result backend lives in the deployment's Redis); its reply channel under
        ``key_prefix``."""
        subscribers = subscriber_urls(redis_url)
        return cls(async_client(redis_url), backend.get_key_for_task, backend.decode_result,
                   subscribers if subscribers != [redis_url] else (), key_prefix)

    async def listening(self) -> int | None:
        """Subscribe to the reply channel (once; again after a lost connection) and return the
        connection's generation, for ``wait(since=)``: a task submitted naming
        ``reply_channel`` after this returns has its result published to this waiter.  None
        when Redis cannot be reached now (the task is then submitted without the channel)."""
        try:
            await self._ensure_reader()
        except (redis.RedisError, OSError) as exc:
            log.warning("result waiter: cannot listen on its reply channel (%s)", exc)
            return None
        return self._generation

    async def _ensure_reader(self) -> None:
        async with self._start_lock:
            if self._reader is not None and not self._reader.done():
                return
            self._pubsub = (await self._next_subscriber()).pubsub()
            event = self._confirmed[self._reply] = asyncio.Event()
            await self._pubsub.subscribe(self._reply)
            self._reader = asyncio.get_running_loop().create_task(self._read())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), SUBSCRIBED_WAIT_S)
            self._generation += 1

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
                if channel == self._reply:
                    self._replied(message["data"])
                else:
                    self._deliver(channel, message["data"])

    def _replied(self, payload: bytes) -> None:
        """A final meta published to the reply channel: to the request waiting for its task,
        else kept for the request about to wait (the newest EARLY_MAX)."""
        try:
            meta = self._decode(payload)
            key = self._key_for_task(meta["task_id"])
        except Exception:   # noqa: BLE001 -- not a task's meta: nobody here waits for it
            return
        if key in self._waiters:
            self._deliver(key, payload, meta)
            return
        self._early[key] = meta
        while len(self._early) > EARLY_MAX:
            self._early.popitem(last=False)

    def _deliver(self, key: bytes, payload: bytes, meta: dict[str, Any] | None = None) -> None:
        futures = self._waiters.get(key)
        if not futures:
            return
        if meta is None:
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

    async def wait(self, task_id: str, timeout_s: float, gone: Callable[[], Awaitable[bool]] | None = None,
                   since: int | None = None) -> dict[str, Any] | None:
        """The task's ready meta; None once ``timeout_s`` passed or ``gone()`` said the
        client left.  ``since``: the generation ``listening`` returned before the task was
        submitted naming ``reply_channel`` (its result comes there); None: a task that may not
        name it (a subscription to its result key's channel)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        key = self._key_for_task(task_id)
        early = self._early.pop(key, None)
        if early is not None and early.get("status") in states.READY_STATES:
            return early
        fut: asyncio.Future = loop.create_future()
        first = key not in self._waiters
        self._waiters.setdefault(key, set()).add(fut)
        replied = since is not None
        try:
            if not replied:
                await self._subscribe(key, first)
            # listening since before the submit, on the same connection: the publish cannot be
            # missed, so no read first
            read = not replied or since != self._generation or self._reader is None or self._reader.done()
            while True:
                meta = await self._stored(key) if read else None
                read = True
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
                    await self._subscribe(key, not replied)   # replied: the reader again, on its channel
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
        self._early.pop(key, None)
        if self._confirmed.pop(key, None) is None:    # waited on the reply channel: nothing to undo
            return
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


def waiter_for(backend: Any, redis_url: str, key_prefix: str = "") -> ResultWaiter:
    """The running event loop's waiter (one pub/sub connection per loop and process)."""
    loop = asyncio.get_running_loop()
    waiter = _waiters.get(loop)
    if waiter is None:
        waiter = _waiters[loop] = ResultWaiter.for_backend(backend, redis_url, key_prefix)
    return waiter
