"""A pool's health as the router sees it -- its circuit breaker (``Keys.circuit``,
written by lua/upstream/circuit.lua from the workers), whether a 429 drained it
(``blocked_until_ms`` of its bucket) and how long its bucket needs to admit a
request -- and the choice of pool for a reserved-tier request (pure:
``choose_pool``).  The producer routes reserved tiers with it at submit; the
workers fail over at dispatch (gateway_tasks/upstream/failover.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import redis

from gateway_tasks.core.redis_client import queue_time
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class PoolHealth:
    pool: str
    now_ms: int
    circuit: str = CLOSED
    open_until_ms: int = 0
    failures: int = 0
    blocked_until_ms: int = 0
    tokens: float = math.inf        # refilled to now_ms
    requests: float = math.inf

    def unavailable(self, pool: Pool, est_tokens: int, max_wait_ms: float) -> str:
        """Why a reserved-tier request should not wait for this pool ("" = it may)."""
        if self.circuit == OPEN and self.now_ms < self.open_until_ms:
            return (f"pool {self.pool}'s circuit is open ({self.failures} consecutive upstream "
                    f"failures) for {(self.open_until_ms - self.now_ms) / 1000:.1f} s more")
        if self.blocked_until_ms > self.now_ms:
            return (f"pool {self.pool} is drained by an upstream 429 for "
                    f"{(self.blocked_until_ms - self.now_ms) / 1000:.1f} s more")
        wait = admit_wait_ms(pool, self.tokens, self.requests, est_tokens)
        if wait > max_wait_ms:
            return (f"pool {self.pool}'s bucket needs {wait / 1000:.1f} s to admit {est_tokens} tokens, "
                    f"over the tier's max wait of {max_wait_ms / 1000:g} s")
        return ""


def admit_wait_ms(pool: Pool, tokens: float, requests: float, est_tokens: int) -> float:
    """ms until a bucket at (tokens, requests) holds est_tokens and one request (pure)."""
    tcap, trate, _rcap, rrate = pool.rates()
    need_t = min(est_tokens, tcap) - tokens
    need_r = 1 - requests
    return max(0.0, need_t / trate if need_t > 0 else 0.0, need_r / rrate if need_r > 0 else 0.0)


def _f(raw: dict[bytes, bytes], name: str, default: float) -> float:
    try:
        return float(raw[name.encode()])
    except (KeyError, ValueError):
        return default


def read_health(client: redis.Redis, keys: Keys, pools: Sequence[Pool]) -> dict[str, PoolHealth]:
    """Every named pool's health, refilled to Redis TIME, in one round trip."""
    with client.pipeline(transaction=False) as pipe:
        queue_time(pipe)
        for pool in pools:
            pipe.hgetall(keys.bucket(pool.name))
            pipe.hgetall(keys.circuit(pool.name))
        replies = pipe.execute()
    sec, usec = replies[0]
    now = int(sec) * 1000 + int(usec) // 1000
    out = {}
    for i, pool in enumerate(pools):
        bucket, circuit = replies[1 + 2 * i], replies[2 + 2 * i]
        tcap, trate, rcap, rrate = pool.rates()
        dt = max(0.0, now - _f(bucket, "ts_ms", now))
        tokens = min(tcap, _f(bucket, "tokens", tcap) + dt * trate)
        requests = min(rcap, _f(bucket, "requests", rcap) + dt * rrate)
        state = circuit.get(b"state", CLOSED.encode()).decode()
        out[pool.name] = PoolHealth(pool.name, now, state, int(_f(circuit, "open_until_ms", 0)),
                                    int(_f(circuit, "failures", 0)),
                                    int(_f(bucket, "blocked_until_ms", 0)), tokens, requests)
    return out


@dataclass(frozen=True)
class Route:
    pool: Pool
    reason: str = ""     # why not the primary ("" = the primary)


def choose_pool(primary: Pool, backups: Sequence[Pool], health: dict[str, PoolHealth],
                est_tokens: int, max_wait_ms: float) -> Route:
    """The primary, unless it is unavailable and a backup is not: then the first such backup."""
    why = health[primary.name].unavailable(primary, est_tokens, max_wait_ms) if primary.name in health else ""
    if not why:
        return Route(primary)
    for backup in backups:
        h = health.get(backup.name)
        if est_tokens > backup.token_capacity:
            continue   # could never be admitted there
        if h is not None and not h.unavailable(backup, est_tokens, max_wait_ms):
            return Route(backup, why)
    return Route(primary)
