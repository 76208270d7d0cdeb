"""A tenant's usage counters: per clock hour, in Redis, kept ``usage_retention_days``.

    UsageCall(keys, tenant, now_ms, retention_days, {REQUESTS: 1, ...})   # lua/usage/count.lua
    read_usage(r, keys, tenant, now_ms, hours)                           # one pipelined read

One hash per tenant and hour, ``Keys.tenant_usage(tenant, hour)`` (hour = epoch s // 3600),
under the tenant's hash tag ``{t:<tenant>}``: single-slot on Redis Cluster.  The fields
(COUNTERS) are written where each event happens, riding an existing round trip where
there is one: a task's outcome with its settle (workers/pipeline.py), a refusal at submit
on its error path.  Days are sums of their hours (``by_day``), done on read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import layout

REQUESTS = "requests"              # tasks the upstream served (one upstream answer each)
EST_TOKENS = "est_tokens"          # their estimated tokens, as debited at dispatch
ACTUAL_TOKENS = "actual_tokens"    # their tokens as the upstream reported them (prompt + completion)
FAILED = "failed"                  # tasks that ended at a worker without an answer (not expiries)
EXPIRED = "expired"                # tasks that waited past their queue TTL or deadline
ABSORBED_429 = "upstream_429"      # upstream 429s the gateway absorbed (requeued or failed over)
DEGRADED = "degraded"              # served with a capped max_tokens, another model or pool
DEFERRED = "deferred"              # submits the load level deferred (Deferred)
REFUSED = "refused"                # submits refused with a 429 (queue full, quota spent)
COUNTERS = (REQUESTS, EST_TOKENS, ACTUAL_TOKENS, FAILED, EXPIRED, ABSORBED_429, DEGRADED, DEFERRED, REFUSED)

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def hour_of(now_ms: int) -> int:
    """The clock hour of a time (epoch seconds // 3600)."""
    return now_ms // HOUR_MS


def expire_at_ms(hour: int, retention_days: int) -> int:
    """When an hour's counters go: the hour's end plus the retention (pure)."""
    return (hour + 1) * HOUR_MS + retention_days * DAY_MS


@dataclass(frozen=True)
class UsageCall:
    """lua/usage/count.lua: add ``counts`` to the tenant's counters of the hour of ``now_ms``."""

    SCRIPT: ClassVar[str] = "usage/count"

    keys: Keys
    tenant_id: str
    now_ms: int
    retention_days: int
    counts: Mapping[str, int]

    @property
    def script_keys(self) -> list[str]:
        return layout(self.SCRIPT).keys(hour=self.keys.tenant_usage(self.tenant_id, hour_of(self.now_ms)))

    @property
    def script_args(self) -> list[Any]:
        flat: list[Any] = []
        for name, n in self.counts.items():
            flat += [name, int(n)]
        return layout(self.SCRIPT).args(expire_at_ms=expire_at_ms(hour_of(self.now_ms), self.retention_days),
                                        counts=flat)

    def parse(self, reply: Any) -> int:
        return int(reply)


def read_usage(r: redis.Redis, keys: Keys, tenant_id: str, now_ms: int, hours: int) -> list[dict[str, Any]]:
    """The tenant's counters of the last ``hours`` clock hours (the current one included),
    oldest first: ``{hour_ms, <every counter>}``, zeros where nothing happened."""
    last = hour_of(now_ms)
    wanted = list(range(last - hours + 1, last + 1))
    with r.pipeline(transaction=False) as pipe:
        for hour in wanted:
            pipe.hgetall(keys.tenant_usage(tenant_id, hour))
        got = pipe.execute()
    rows = []
    for hour, raw in zip(wanted, got):
        row: dict[str, Any] = {"hour_ms": hour * HOUR_MS}
        found = {k.decode(): int(v) for k, v in raw.items()}
        row.update({name: found.get(name, 0) for name in COUNTERS})
        rows.append(row)
    return rows


def by_day(hours: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Hourly rows summed per UTC day, oldest first: ``{day_ms, <every counter>}`` (pure)."""
    days: dict[int, dict[str, Any]] = {}
    for row in hours:
        day = int(row["hour_ms"]) // DAY_MS * DAY_MS
        out = days.setdefault(day, {"day_ms": day, **{name: 0 for name in COUNTERS}})
        for name in COUNTERS:
            out[name] += int(row.get(name, 0))
    return [days[d] for d in sorted(days)]


def totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Every counter summed over rows (pure)."""
    return {name: sum(int(row.get(name, 0)) for row in rows) for name in COUNTERS}


def usage_report(r: redis.Redis, keys: Keys, tenant_id: str, now_ms: int, hours: int, days: int,
                 retention_days: int) -> dict[str, Any]:
    """GET /v1/usage and ``gateway tenant usage``: the last ``hours`` hours and the last ``days``
    UTC days (the current ones included, none past the retention), with their totals."""
    days = max(1, min(days, retention_days))
    hours = max(1, min(hours, retention_days * 24))
    span = max(hours, days * 24 - (DAY_MS - now_ms % DAY_MS) // HOUR_MS)
    rows = read_usage(r, keys, tenant_id, now_ms, span)
    return {"object": "usage", "tenant_id": tenant_id, "retention_days": retention_days,
            "counters": list(COUNTERS), "hours": rows[-hours:], "days": by_day(rows)[-days:],
            "totals": {"hours": totals(rows[-hours:]), "days": totals(by_day(rows)[-days:])}}
