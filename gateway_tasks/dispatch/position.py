"""Where a queued task stands in its tier: read-only, from the index entries and their ranks.

    spot = read_spot(r, keys, pool, tier, tenant, entry, tag, task_id)   # two pipelined round trips
    ahead = tier_ahead(spot.own_ahead, spot.own_est, spot.own_weight, spot.others)

A tier's index (``Keys.index``) holds one entry per queued task, ordered by tenant then
seq (``gateway_tasks.dispatch.index_entry``), so a task's place in its own tenant's line is
a ``ZLEXCOUNT`` from the tenant's first entry to its own.  The tenants in line are the
members of the tier's active set and the tier's parked tenants (at their concurrency cap);
each one's queued count and head entry (its weight, its task size) are two more reads.
Nothing here reads the active set's scores (how pick.lua orders tenants is its own
business, lua/dispatch/pick.lua): between tenants the estimate is weighted fair sharing by
tokens, which is what every pick policy converges to inside a tier.

Pure functions (``tier_ahead``, ``tier_rate_per_s``, ``expected_wait_s``) do the arithmetic;
``read_spot`` is the only Redis code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import redis

from gateway_tasks.core.redis_client import queue_time
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.index_entry import IndexEntry, tenant_range

MAX_TENANTS_READ = 2_000   # tenants of a tier whose lines are counted one by one (the rest: estimated)


@dataclass(frozen=True)
class OtherLine:
    """Another tenant's line in the tier: its queued tasks, its weight, its head task's tokens."""

    tenant: str
    queued: int
    weight: float
    est_tokens: int


@dataclass(frozen=True)
class Spot:
    """What Redis says of one queued task's place (``read_spot``)."""

    queued: bool               # its entry is in the tier's index now
    own_ahead: int             # its own tenant's tasks ahead of it
    own_queued: int            # its own tenant's tasks queued in the tier (it included)
    tier_queued: int           # every task queued in the tier
    own_est: int
    own_weight: float
    others: tuple[OtherLine, ...]
    parked: bool               # its tenant is at its concurrency cap (held out of the active set)
    inflight: int              # its tenant's tasks dispatched and not acked on this pool
    held: bool                 # held on its dependencies (lifecycle), not queued yet
    dispatched: bool           # its delivery tag is dispatched (running)
    bucket: dict[str, float]   # the pool's bucket fields (tokens, ts_ms, blocked_until_ms)
    other_tiers_queued: dict[str, int]   # the pool's other tiers' queued tasks
    now_ms: int


def tier_ahead(own_ahead: int, own_est: int, own_weight: float, others: Sequence[OtherLine]) -> int:
    """Tasks dispatched in the tier before this one, under weighted fair sharing by tokens:
    the task's virtual finish is ``(own_ahead + 1) x own_est / own_weight`` (its tenant's line
    through it); another tenant's k-th task finishes at ``k x its size / its weight``, and
    those that finish strictly earlier go first -- never more than it has queued (pure)."""
    finish = (own_ahead + 1) * max(1, own_est) / max(own_weight, 1e-9)
    total = own_ahead
    for o in others:
        if o.queued <= 0:
            continue
        before = math.ceil(finish * o.weight / max(1, o.est_tokens) - 1e-9) - 1
        total += min(o.queued, max(0, before))
    return total


def tier_rate_per_s(samples: Sequence[Mapping[str, Any]], tier: str) -> float | None:
    """The tier's measured dispatch rate (tasks/s), from the overload controller's counter
    samples (newest and oldest kept, cumulative ``tiers.<tier>.dispatched``); None when fewer
    than two samples or no time between them (pure)."""
    timed = sorted((int(s["ts_ms"]), float(s.get("tiers", {}).get(tier, {}).get("dispatched", 0)))
                   for s in samples if isinstance(s, Mapping) and "ts_ms" in s)
    if len(timed) < 2 or timed[-1][0] <= timed[0][0]:
        return None
    (t0, d0), (t1, d1) = timed[0], timed[-1]
    return max(0.0, d1 - d0) / ((t1 - t0) / 1000.0)


def capacity_rate_per_s(tpm: float, share: float, est_tokens: float) -> float:
    """The tier's dispatch rate its share of the pool's TPM allows at a task size (tasks/s)."""
    return tpm / 60.0 * share / max(1.0, est_tokens)


def expected_wait_s(tier_ahead_n: int, rate_per_s: float, own_ahead: int, cap: int,
                    latency_s: float | None) -> float:
    """Seconds until the task starts: the tasks ahead of it in its tier at the tier's rate, and
    never less than its own tenant's line through its concurrency cap (``cap`` at a time, each
    ``latency_s`` long; cap 0 = none) (pure)."""
    tier_s = tier_ahead_n / rate_per_s if rate_per_s > 0 else math.inf
    own_s = 0.0
    if cap > 0 and latency_s:
        own_s = (own_ahead // cap) * latency_s
    return max(tier_s, own_s)


def read_spot(r: redis.Redis, keys: Keys, pool: str, tier: str, tiers: Sequence[str], tenant: str,
              entry: str, tag: str, task_id: str) -> Spot:
    """The task's place, read in two pipelined round trips (plain reads, nothing written)."""
    index, low = keys.index(pool, tier), tenant_range(tenant)[0]
    with r.pipeline(transaction=False) as pipe:
        queue_time(pipe)
        pipe.zscore(index, entry) if entry else pipe.exists("")
        pipe.zlexcount(index, low, f"({entry}") if entry else pipe.exists("")
        pipe.zlexcount(index, *tenant_range(tenant))
        pipe.zcard(index)
        pipe.zrange(keys.active(pool, tier), 0, MAX_TENANTS_READ - 1)
        pipe.hgetall(keys.parked(pool))
        pipe.hget(keys.inflight(pool), tenant)
        pipe.exists(keys.held(task_id))
        pipe.hexists(keys.dispatched(pool), tag) if tag else pipe.exists("")
        pipe.hmget(keys.bucket(pool), "tokens", "ts_ms", "blocked_until_ms")
        for other in tiers:
            pipe.zcard(keys.index(pool, other))
        (sec, usec), score, own_ahead, own_queued, tier_queued, active, parked, inflight, held, dispatched, \
            bucket, *tier_depths = pipe.execute()
    parked_here = {t.decode(): v.decode() for t, v in parked.items() if v.decode() == tier}
    in_line = [t.decode() for t in active] + [t for t in parked_here if t.encode() not in active]
    others = [t for t in in_line if t != tenant][:MAX_TENANTS_READ]
    lines: list[OtherLine] = []
    own_est, own_weight = 0, 1.0
    if entry:
        own = IndexEntry.decode(entry)
        own_est, own_weight = own.est_tokens, own.weight
    if others:
        with r.pipeline(transaction=False) as pipe:
            for t in others:
                lo, hi = tenant_range(t)
                pipe.zlexcount(index, lo, hi)
                pipe.zrangebylex(index, lo, hi, start=0, num=1)
            got = pipe.execute()
        for i, t in enumerate(others):
            count, head = int(got[2 * i]), got[2 * i + 1]
            try:
                h = IndexEntry.decode(head[0]) if head else None
            except (ValueError, UnicodeDecodeError):
                h = None
            lines.append(OtherLine(t, count, h.weight if h else 1.0, h.est_tokens if h else max(1, own_est)))
    num = lambda v: float(v) if v is not None else 0.0  # noqa: E731
    return Spot(queued=score is not None and bool(entry), own_ahead=int(own_ahead or 0),
                own_queued=int(own_queued), tier_queued=int(tier_queued), own_est=own_est,
                own_weight=own_weight, others=tuple(lines), parked=tenant in parked_here,
                inflight=int(inflight or 0), held=bool(held), dispatched=bool(dispatched),
                bucket={"tokens": num(bucket[0]), "ts_ms": num(bucket[1]), "blocked_until_ms": num(bucket[2])},
                other_tiers_queued={t: int(d) for t, d in zip(tiers, tier_depths) if t != tier},
                now_ms=int(sec) * 1000 + int(usec) // 1000)

