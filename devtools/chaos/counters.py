"""Checks that no counter leaked once every task is final: the pool's dispatch
state (in-flight per tenant, parked tenants, dispatched hash and lease set,
queued messages, depth, indexes, active tenants; kombu's unacked hash) must be
empty, and the bucket must hold what its ledger says: its level before, plus
refill, minus what the upstream really charged (``bucket_ledger``)."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, Settings


def leftovers(client: redis.Redis, keys: Keys, settings: Settings) -> dict[str, int]:
    """Every dispatch counter or structure that is not back to empty: name -> size."""
    out: dict[str, int] = {}
    for pool in settings.pools:
        p = pool.name
        sizes = {
            "inflight": sum(int(v) for v in client.hvals(keys.inflight(p))),
            "parked": client.hlen(keys.parked(p)),
            "dispatched": client.hlen(keys.dispatched(p)),
            "leases": client.zcard(keys.dispatched_at(p)),
            "messages": client.hlen(keys.messages(p)),
        }
        for tier in settings.tiers:
            sizes[f"index:{tier.name}"] = client.zcard(keys.index(p, tier.name))
            sizes[f"active:{tier.name}"] = client.zcard(keys.active(p, tier.name))
        out.update({f"{p}.{k}": v for k, v in sizes.items() if v})
    unacked = client.hlen(keys.unacked)
    if unacked:
        out["unacked"] = unacked
    return out


def describe(found: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(found.items())) or "none"


@dataclass(frozen=True)
class Level:
    tokens: float
    requests: float
    at_ms: int


def refilled(level: float, cap: float, rate_per_ms: float, elapsed_ms: float) -> float:
    """A continuous bucket's level after elapsed_ms of refill (as lua/core/prelude.lua computes it)."""
    return min(cap, level + max(0.0, elapsed_ms) * rate_per_ms)


def read_level(client: redis.Redis, keys: Keys, pool: Pool) -> Level:
    """The pool bucket's levels now (Redis clock), refilled like pick.lua would."""
    sec, usec = client.time()
    now = int(sec) * 1000 + int(usec) // 1000
    raw = client.hmget(keys.bucket(pool.name), "tokens", "requests", "ts_ms")
    if raw[0] is None:
        return Level(pool.token_capacity, pool.request_capacity, now)
    tcap, trate, rcap, rrate = pool.rates()
    ts = int(float(raw[2]))
    return Level(refilled(float(raw[0]), tcap, trate, now - ts), refilled(float(raw[1]), rcap, rrate, now - ts), now)


def set_level(client: redis.Redis, keys: Keys, pool: Pool, tokens: float, requests: float) -> Level:
    """Put the bucket at a known level (below capacity, so refill is never capped in a
    short run and the ledger is exact)."""
    sec, usec = client.time()
    now = int(sec) * 1000 + int(usec) // 1000
    client.hset(keys.bucket(pool.name), mapping={"tokens": tokens, "requests": requests, "ts_ms": now})
    return Level(tokens, requests, now)


def expected_level(before: Level, after_ms: int, pool: Pool, charged_tokens: float,
                   charged_requests: float) -> tuple[float, float]:
    """What the bucket should hold at after_ms: before + refill - what the upstream charged
    (assumes the level stayed below capacity)."""
    tcap, trate, rcap, rrate = pool.rates()
    dt = after_ms - before.at_ms
    return (before.tokens + dt * trate - charged_tokens, before.requests + dt * rrate - charged_requests)


def ledger_gap(before: Level, after: Level, pool: Pool, charged_tokens: float,
               charged_requests: float) -> tuple[float, float]:
    """(tokens, requests) the bucket holds beyond its ledger: negative = leaked (not refunded)."""
    want_t, want_r = expected_level(before, after.at_ms, pool, charged_tokens, charged_requests)
    return after.tokens - want_t, after.requests - want_r
