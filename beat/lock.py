"""The beat leader lock: several beat processes, one active.

``SET lock token NX PX ttl`` acquires; renewing and releasing compare the
stored token with ours inside Lua, so a process never extends or deletes a
lock another process took over after ours expired.

Timing, in tick intervals (``lock_ttl_s``, ``leader_renew_s``,
``follower_retry_s``, ``takeover_within_s``): the leader comes back at least
every half tick and renews the lock to 1.5 ticks, so a healthy leader rides
out a pause of a whole tick; a follower tries every quarter tick, so when the
leader dies its lock lapses within 1.5 ticks of its last renewal and a
follower holds it within 1.75 ticks of the fault -- under the 2 ticks the
fault suite asks for.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import redis

from gateway_tasks.core.scripts import layout, scripts_for


def new_token() -> str:
    """hostname:pid:random -- unique per process, readable in `redis-cli GET`."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class TokenLockCall:
    """A lock script that acts only while the lock still holds our token; True if it did."""

    SCRIPT: ClassVar[str]
    key: str
    token: str

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(lock=self.key)

    def parse(self, reply: Any) -> bool:
        return bool(reply)


@dataclass(frozen=True)
class LockRenewCall(TokenLockCall):
    """lua/beat/lock_renew.lua: extend the lock to ttl_ms."""

    SCRIPT: ClassVar[str] = "beat/lock_renew"

    ttl_ms: int

    @property
    def script_args(self) -> list[str | int]:
        return layout(self.SCRIPT).args(token=self.token, ttl_ms=self.ttl_ms)


@dataclass(frozen=True)
class LockReleaseCall(TokenLockCall):
    """lua/beat/lock_release.lua: delete the lock."""

    SCRIPT: ClassVar[str] = "beat/lock_release"

    @property
    def script_args(self) -> list[str]:
        return layout(self.SCRIPT).args(token=self.token)


LOCK_TTL_TICKS = 1.5       # the lock lives this long after each renewal
LEADER_RENEW_TICKS = 0.5   # the leader's longest sleep between renewals
FOLLOWER_RETRY_TICKS = 0.25  # a follower's SET NX attempts, this often


def lock_ttl_ms(tick_s: float) -> int:
    return int(round(LOCK_TTL_TICKS * tick_s * 1000))


def leader_renew_s(tick_s: float) -> float:
    return LEADER_RENEW_TICKS * tick_s


def follower_retry_s(tick_s: float) -> float:
    return FOLLOWER_RETRY_TICKS * tick_s


def renewal_slack_s(tick_s: float) -> float:
    """How long a healthy leader may stall (GC, a slow Redis) without losing the lock."""
    return lock_ttl_ms(tick_s) / 1000.0 - leader_renew_s(tick_s)


def takeover_within_s(tick_s: float) -> float:
    """Worst case from a leader's death to a follower holding the lock: the TTL left
    after a renewal just before the fault, plus one follower retry interval."""
    return lock_ttl_ms(tick_s) / 1000.0 + follower_retry_s(tick_s)


class BeatLock:
    def __init__(self, client: redis.Redis, key: str, ttl_ms: int, token: str | None = None):
        if ttl_ms <= 0:
            raise ValueError(f"lock ttl_ms must be > 0, got {ttl_ms}")
        self.r = client
        self.key = key
        self.ttl_ms = int(ttl_ms)
        self.token = token or new_token()
        self.scripts = scripts_for(client)
        self.held = False

    def acquire(self) -> bool:
        """Take the lock if free (or renew it if already ours)."""
        if self.r.set(self.key, self.token, nx=True, px=self.ttl_ms):
            self.held = True
        else:
            self.held = self.renew()
        return self.held

    def renew(self) -> bool:
        """Extend our lock; False (and no longer held) if it is not ours any more."""
        self.held = self.scripts.run(LockRenewCall(self.key, self.token, self.ttl_ms))
        return self.held

    def release(self) -> bool:
        """Give the lock up (on shutdown) so a follower takes over at once."""
        released = self.scripts.run(LockReleaseCall(self.key, self.token))
        self.held = False
        return released

    def owner(self) -> str | None:
        value = self.r.get(self.key)
        return value.decode() if value is not None else None
