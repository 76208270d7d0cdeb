"""Leases: a dispatcher's hold on the tasks it took, and the recovery of a dead one's.

pick.lua records every dispatch with a lease (``Settings.lease_s``, default 5 s)
as its score in the pool's ``dispatched-at`` set.  A live dispatcher's
``LeaseKeeper`` thread renews the leases of the tasks it still holds every
third of a lease (lua/dispatch/renew.lua; a long upstream call keeps its task), and
sweeps every pool for leases that expired: those tasks' holder died (kill -9,
lost node, SIGSTOP past its lease), so they go back to the front of their
tenant's line with their original enqueue time and their tenant's slot freed
(lua/dispatch/release.lua, exactly once however many survivors sweep).  A holder that
comes back after losing a task (SIGSTOP) and finishes it anyway is told so by
release.lua (``Released.stale``) and counted in ``stale_releases``: the
upstream call was duplicated, the result is the task id's (idempotent).  The
visibility timeout stays as the last resort: a lease is never renewed past it.
A holder that died after storing its task's final result but before the ack
(``GATEWAY_FAULT_KILL_AT=after_settle``'s neighbour) leaves a task that is done:
the sweep acks it instead of running it again (``finished_not_acked``).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable

import redis

from gateway_tasks.core.clock import redis_now_ms
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import Scripts
from gateway_tasks.core.settings import Settings
from gateway_tasks.core.stats import FINISHED_NOT_ACKED
from gateway_tasks.dispatch.release import ACK, REQUEUE, ReleaseCall, RenewCall

logger = logging.getLogger(__name__)
SWEEP_LIMIT = 200  # expired tasks restored per pool per sweep
FINAL_STATES = ("SUCCESS", "FAILURE")


def already_final(client: redis.Redis, keys: Keys, pool: str, tag: str) -> bool:
    """Whether the task behind a dispatched tag already has its final result stored."""
    raw = client.hget(keys.messages(pool), tag)
    if raw is None:
        return False
    try:
        task_id = (json.loads(raw).get("headers") or {}).get("id")
        meta = client.get(keys.result(str(task_id))) if task_id else None
        return meta is not None and json.loads(meta).get("status") in FINAL_STATES
    except (ValueError, AttributeError):
        return False


def sweep_expired(client: redis.Redis, scripts: Scripts, keys: Keys, settings: Settings,
                  limit: int | None = SWEEP_LIMIT) -> int:
    """Restore every task whose lease expired (Redis clock); returns how many this call did."""
    now_ms = redis_now_ms(client)
    restored = 0
    for pool in settings.pools:
        tags = client.zrange(keys.dispatched_at(pool.name), "-inf", now_ms, byscore=True,
                             offset=0, num=limit or SWEEP_LIMIT)
        for tag in tags:
            tag_s = tag.decode()
            cancelled = _is_cancelled(client, keys, pool.name, tag)
            done = not cancelled and already_final(client, keys, pool.name, tag_s)
            call = ReleaseCall(keys, settings, pool.name, tag_s, ACK if done or cancelled else REQUEUE,
                               expired_only=True)
            if not scripts.run(call).released:
                continue
            if cancelled:   # its holder died after it was cancelled: drop it, never resurrect it
                logger.warning("task %s: its dispatcher's lease expired; cancelled, dropped", call.tag)
                continue
            restored += 1
            if done:
                client.hincrby(keys.stats(pool.name), FINISHED_NOT_ACKED, 1)
                logger.warning("task %s: its dispatcher died after storing its result; acked", call.tag)
            else:
                logger.warning("task %s: its dispatcher's lease expired; back in line", call.tag)
    return restored


def _is_cancelled(client: redis.Redis, keys: Keys, pool: str, tag: bytes) -> bool:
    """Whether the task of a dispatched delivery tag was cancelled (Keys.cancelled of its id)."""
    raw = client.hget(keys.messages(pool), tag)
    try:
        task_id = (json.loads(raw).get("headers") or {}).get("id") if raw else None
    except (ValueError, AttributeError):
        return False
    return isinstance(task_id, str) and bool(client.exists(keys.cancelled(task_id)))


class LeaseKeeper:
    """Renews one dispatcher's leases and sweeps expired ones, on its own thread."""

    def __init__(self, client: redis.Redis, scripts: Scripts, keys: Keys, settings: Settings,
                 held: Callable[[], dict[str, tuple[str, str]]]):
        self.client, self.scripts, self.keys, self.settings = client, scripts, keys, settings
        self.held = held          # tag -> (pool, token) of the tasks the dispatcher holds now
        self.interval_s = settings.lease_s / 3.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gateway-leases", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> tuple[int, int]:
        """One renewal of the held leases and one sweep: (renewed, restored)."""
        by_pool: dict[str, list[tuple[str, str]]] = {}
        for tag, (pool, token) in list(self.held().items()):
            by_pool.setdefault(pool, []).append((tag, token))
        renewed = 0
        for pool, held in by_pool.items():
            renewed += self.scripts.run(RenewCall(
                self.keys, pool, tuple(held), int(self.settings.lease_s * 1000),
                int(self.settings.visibility_timeout_s * 1000)))
        return renewed, sweep_expired(self.client, self.scripts, self.keys, self.settings)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except redis.RedisError:
                logger.warning("lease renewal failed; retrying in %.1f s", self.interval_s, exc_info=True)
