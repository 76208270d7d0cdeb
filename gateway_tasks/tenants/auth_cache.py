"""An API process's short memory of the API keys it authenticated (``settings.auth_cache_s``).

A request whose key was authenticated in the last ``auth_cache_s`` seconds is authenticated
from memory: no Redis read, no thread.  Revocation stays effective at once:

* every change of a tenant's key or registration (``TenantRegistry.register`` -- a key rotated,
  a tier changed -- and ``delete``) is announced on one pub/sub channel
  (``Keys.tenants_changed``), after the change is written;
* each API process listens on it (``listening``) and drops the tenant's entries when the
  notice arrives -- within the pub/sub's delivery time, well under a millisecond on a local
  network; a lookup that was under way when a notice arrived is not kept (its answer may be
  older than the notice);
* the cache is used only while that listener is subscribed: from a lost connection until it
  is subscribed again every request reads Redis, and what was kept before is dropped (a
  notice may have been missed).  A connection that dies without the process noticing is the
  one case left: its entries still end ``auth_cache_s`` after they were read.

Only successful authentications are kept (an unknown key always reads Redis), under the key's
SHA-256 digest (never the key itself), at most ``auth_cache_entries`` of them (the oldest
goes first).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.redis_client import async_client, subscriber_urls
from gateway_tasks.tenants.registry import Tenant

log = logging.getLogger(__name__)

EVERY_TENANT = "*"           # a notice that drops every entry
SUBSCRIBED_WAIT_S = 1.0      # how long to wait for Redis to confirm the subscription
READ_TIMEOUT_S = 1.0


class AuthCache:
    """One per API process: ``cached(key)`` from memory, else the caller authenticates through
    Redis between ``token()`` and ``keep(key, tenant, token)``."""

    def __init__(self, redis_url: str, keys: Keys, ttl_s: float, max_entries: int):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._url = redis_url
        self._channel = keys.tenants_changed.encode()
        self.client_name = f"{keys.prefix}auth-cache"    # its connection's name (CLIENT LIST)
        self._entries: OrderedDict[bytes, tuple[float, Tenant]] = OrderedDict()
        self._epoch = 0            # notices heard and connections (re)made so far
        self._live = False         # the listener is subscribed now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: asyncio.Task | None = None
        self._confirmed: asyncio.Event | None = None
        self._connections = 0      # listener connections made (the next goes to the next node)

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __repr__(self) -> str:   # never a key, nor a digest of one
        return f"AuthCache(ttl_s={self.ttl_s}, entries={len(self._entries)}, live={self._live})"

    @staticmethod
    def _digest(api_key: str) -> bytes:
        return hashlib.sha256(api_key.encode("utf-8", "replace")).digest()

    def cached(self, api_key: str) -> Tenant | None:
        """The tenant of ``api_key`` if it was authenticated here within ``ttl_s`` and the
        listener has stayed subscribed since; else None (authenticate through Redis)."""
        if not self._live or not self._is_current_loop():
            return None
        digest = self._digest(api_key)
        found = self._entries.get(digest)
        if found is None:
            return None
        if found[0] <= time.monotonic():
            self._entries.pop(digest, None)
            return None
        return found[1]

    def token(self) -> int | None:
        """Taken before a lookup through Redis: ``keep`` stores its answer only if no notice
        arrived (and the listener stayed subscribed) meanwhile.  None: nothing will be kept."""
        return self._epoch if self._live and self._is_current_loop() else None

    def keep(self, api_key: str, tenant: Tenant, token: int | None) -> None:
        if token is None or token != self._epoch or not self._live:
            return
        self._entries[self._digest(api_key)] = (time.monotonic() + self.ttl_s, tenant)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, tenant_id: str) -> None:
        """Drop a tenant's entries (EVERY_TENANT: all of them); a lookup under way is not kept."""
        self._epoch += 1
        if tenant_id == EVERY_TENANT:
            self._entries.clear()
            return
        for digest in [d for d, (_, t) in self._entries.items() if t.tenant_id == tenant_id]:
            self._entries.pop(digest, None)

    def _is_current_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def listening(self) -> None:
        """Start the listener on the running event loop if it is not running (a new loop, or
        its connection was lost); returns once it is subscribed, or has failed to be."""
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._listener is not None and not self._listener.done():
            return
        self._loop, self._live = loop, False
        self.forget(EVERY_TENANT)
        self._confirmed = asyncio.Event()
        self._listener = loop.create_task(self._listen(self._confirmed))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._confirmed.wait(), SUBSCRIBED_WAIT_S)

    async def _listen(self, confirmed: asyncio.Event) -> None:
        urls = subscriber_urls(self._url)     # on a cluster: a node (a PUBLISH reaches every node)
        client = async_client(urls[self._connections % len(urls)], client_name=self.client_name)
        self._connections += 1
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(self._channel)
            while True:
                message = await pubsub.get_message(timeout=READ_TIMEOUT_S)
                if message is None:
                    continue
                if message["type"] == "subscribe":
                    self.forget(EVERY_TENANT)    # nothing kept from before this subscription
                    self._live = True
                    confirmed.set()
                elif message["type"] == "message":
                    data = message["data"]
                    self.forget(data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data))
        except (redis.RedisError, OSError) as exc:
            log.warning("auth cache: its change listener lost its connection (%s); every request reads "
                        "Redis until it listens again", type(exc).__name__)
        finally:
            self._live = False
            self.forget(EVERY_TENANT)
            confirmed.set()
            with contextlib.suppress(Exception):
                await pubsub.aclose()
            with contextlib.suppress(Exception):
                await client.aclose()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener
