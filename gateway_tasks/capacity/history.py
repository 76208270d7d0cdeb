"""Demand history and the forecast made from it.

Every enqueue counts a request and its estimated tokens in its pool and tier's
per-minute demand (``Keys.demand``: one hash per clock hour, fields ``r<m>`` and
``t<m>``, kept 7 days and an hour; written by lua/dispatch/enqueue.lua, inside
the enqueue it already runs: no command or round trip of its own).  Memory is
bounded by the retention: at most 169 hashes of at most 120 small fields per
(pool, tier), each a listpack of about 1.4 KB (a full hour): ~230 KB per (pool,
tier) for the 7 days.

The forecast, for each (pool, tier), looks ``LEAD_FROM_MIN``..``LEAD_TO_MIN``
minutes ahead (5..10: time for new workers to start before the load arrives):

    history  = P95 of the per-minute demand in that window of time of day on each of
               the last 7 days (7 x 6 = 42 minutes; a minute with nothing enqueued is 0)
    cron     = the busiest minute of the cron schedule's forecast in the same window
               (``gateway_tasks.capacity.forecast``, published by the leader beat)
    combined = max(history, cron)

History already holds the cron runs of past days, so the two are not added: the
schedule's figure wins when it knows more (a cron added since, a storm moved by
the jitter), history when traffic that no schedule knows of is the larger.

The maths here is pure (minute lists, the percentile, the combination); the
reads are planned as plain HMGETs (``plan_reads``) so a caller puts them in its
own pipeline (the metrics exporter: one round trip per scrape), and parsed back
(``parse_reads``).  ``read_forecast`` and ``read_minutes`` do the round trip
themselves (``gateway capacity``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import redis

from gateway_tasks.capacity.forecast import Forecast
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import Keys, demand_fields

MINUTES_PER_DAY = 1440
HISTORY_DAYS = 7
LEAD_FROM_MIN, LEAD_TO_MIN = 5, 10       # the window forecast, in minutes from now (inclusive)
PERCENTILE = 95.0


# -- pure -------------------------------------------------------------------------
def minute_of(ms: int) -> int:
    """Minutes since the epoch of a time in ms."""
    return int(ms) // 60_000


def hour_and_minute(epoch_minute: int) -> tuple[int, int]:
    """(clock hour since the epoch, minute of that hour) of an epoch minute."""
    return divmod(int(epoch_minute), 60)


def same_time_minutes(now_minute: int, days: int = HISTORY_DAYS, lead_from: int = LEAD_FROM_MIN,
                      lead_to: int = LEAD_TO_MIN) -> list[int]:
    """The epoch minutes whose demand forecasts ``lead_from``..``lead_to`` minutes after
    ``now_minute``: that window of time of day on each of the ``days`` previous days."""
    if days < 1 or lead_from < 0 or lead_to < lead_from:
        raise ConfigError(f"history window days={days!r} lead={lead_from!r}..{lead_to!r} is invalid; "
                          f"expected days >= 1 and 0 <= lead_from <= lead_to")
    return [now_minute + k - d * MINUTES_PER_DAY
            for d in range(1, days + 1) for k in range(lead_from, lead_to + 1)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``, interpolated linearly between the two
    closest ranks (numpy's default); 0 for no values."""
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile q={q!r} is invalid; expected 0..100")
    if not values:
        return 0.0
    ordered = sorted(float(v) for v in values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def cron_busiest_minute(fc: Forecast | None, pool: str, tier: str, now_ms: int,
                        lead_from: int = LEAD_FROM_MIN, lead_to: int = LEAD_TO_MIN) -> tuple[float, float]:
    """(runs, tokens) per minute of the busiest forecast bin that overlaps
    ``lead_from``..``lead_to`` minutes after ``now_ms`` (a bin's counts scaled to a
    minute); (0, 0) without a forecast or one that does not reach that far."""
    if fc is None:
        return 0.0, 0.0
    series = fc.series.get((pool, tier))
    if series is None:
        return 0.0, 0.0
    lo_ms, hi_ms = now_ms + lead_from * 60_000, now_ms + (lead_to + 1) * 60_000
    per_minute = 60.0 / fc.bucket_s
    runs = tokens = 0.0
    for i in range(fc.buckets):
        start = fc.start_ms + i * fc.bucket_s * 1000
        if start + fc.bucket_s * 1000 <= lo_ms or start >= hi_ms:
            continue
        runs = max(runs, series.runs[i] * per_minute)
        tokens = max(tokens, series.tokens[i] * per_minute)
    return runs, tokens


@dataclass(frozen=True)
class DemandForecast:
    """One (pool, tier)'s forecast demand per minute, ``LEAD_FROM_MIN``..``LEAD_TO_MIN``
    minutes ahead."""

    pool: str
    tier: str
    history_requests: float
    history_tokens: float
    cron_requests: float
    cron_tokens: float
    samples: int                      # minutes of history read (7 days x 6 minutes)

    @property
    def requests(self) -> float:
        return max(self.history_requests, self.cron_requests)

    @property
    def tokens(self) -> float:
        return max(self.history_tokens, self.cron_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "tier": self.tier, "requests_per_minute": self.requests,
                "tokens_per_minute": self.tokens,
                "history_p95_requests_per_minute": self.history_requests,
                "history_p95_tokens_per_minute": self.history_tokens,
                "cron_requests_per_minute": self.cron_requests, "cron_tokens_per_minute": self.cron_tokens,
                "history_minutes": self.samples}


def forecast_of(pool: str, tier: str, requests: Sequence[float], tokens: Sequence[float],
                fc: Forecast | None, now_ms: int) -> DemandForecast:
    """The forecast from one (pool, tier)'s history samples and the cron forecast."""
    cron_runs, cron_tokens = cron_busiest_minute(fc, pool, tier, now_ms)
    return DemandForecast(pool, tier, percentile(requests, PERCENTILE), percentile(tokens, PERCENTILE),
                          cron_runs, cron_tokens, len(requests))


@dataclass(frozen=True)
class DemandRead:
    """One HMGET of the history: a (pool, tier)'s hour hash and the minutes wanted from it."""

    pool: str
    tier: str
    key: str
    minutes: tuple[int, ...]          # epoch minutes, in the order of ``fields`` (pairs)

    @property
    def fields(self) -> list[str]:
        return [f for m in self.minutes for f in demand_fields(hour_and_minute(m)[1])]


def plan_reads(keys: Keys, cells: Iterable[tuple[str, str]], minutes: Sequence[int]) -> list[DemandRead]:
    """The HMGETs reading ``minutes`` of every (pool, tier) in ``cells``: one per hour hash."""
    by_hour: dict[int, list[int]] = {}
    for m in minutes:
        by_hour.setdefault(hour_and_minute(m)[0], []).append(m)
    return [DemandRead(pool, tier, keys.demand(pool, tier, hour), tuple(ms))
            for pool, tier in cells for hour, ms in sorted(by_hour.items())]


def parse_reads(reads: Sequence[DemandRead], replies: Sequence[Sequence[Any]]
                ) -> dict[tuple[str, str], dict[int, tuple[float, float]]]:
    """(pool, tier) -> epoch minute -> (requests, tokens) from the HMGET replies (a missing
    field is 0)."""
    out: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for read, reply in zip(reads, replies):
        cell = out.setdefault((read.pool, read.tier), {})
        for i, m in enumerate(read.minutes):
            r, t = reply[2 * i], reply[2 * i + 1]
            cell[m] = (float(r or 0), float(t or 0))
    return out


def forecasts(cells: Sequence[tuple[str, str]], minutes: Sequence[int],
              got: dict[tuple[str, str], dict[int, tuple[float, float]]], fc: Forecast | None,
              now_ms: int) -> list[DemandForecast]:
    """Every (pool, tier)'s forecast from the parsed history and the cron forecast."""
    out = []
    for pool, tier in cells:
        cell = got.get((pool, tier), {})
        series = [cell.get(m, (0.0, 0.0)) for m in minutes]
        out.append(forecast_of(pool, tier, [r for r, _ in series], [t for _, t in series], fc, now_ms))
    return out


def peak_multiplier(per_minute: Sequence[float], jitter_window_s: float) -> float | None:
    """The capacity model's peak multiplier as history shows it: in the clock hour holding
    the busiest minute, that minute's rate over the rate the model assumes without one
    (the hour's requests spread evenly over the jitter window); ``per_minute`` is
    consecutive minutes starting on an hour.  None without any demand."""
    if jitter_window_s <= 0:
        raise ConfigError(f"jitter_window_s={jitter_window_s!r} is invalid; expected > 0")
    if not per_minute or max(per_minute) <= 0:
        return None
    busiest = max(range(len(per_minute)), key=lambda i: per_minute[i])
    start = busiest - busiest % 60
    hour_total = sum(per_minute[start:start + 60])
    return (per_minute[busiest] / 60.0) / (hour_total / jitter_window_s)


# -- reads ----------------------------------------------------------------------------
def cells_of(pools: Iterable[str], tiers: Iterable[str]) -> list[tuple[str, str]]:
    tiers = list(tiers)
    return [(p, t) for p in pools for t in tiers]


def read_forecast(client: redis.Redis, keys: Keys, cells: Sequence[tuple[str, str]], now_ms: int,
                  fc: Forecast | None) -> list[DemandForecast]:
    """Every (pool, tier)'s forecast, the history read in one pipeline."""
    minutes = same_time_minutes(minute_of(now_ms))
    reads = plan_reads(keys, cells, minutes)
    with client.pipeline(transaction=False) as pipe:
        for read in reads:
            pipe.hmget(read.key, read.fields)
        replies = pipe.execute()
    return forecasts(cells, minutes, parse_reads(reads, replies), fc, now_ms)


def read_minutes(client: redis.Redis, keys: Keys, cells: Sequence[tuple[str, str]],
                 first_minute: int, count: int) -> list[float]:
    """Requests enqueued in each of ``count`` minutes from ``first_minute``, every (pool,
    tier) of ``cells`` summed (one pipeline)."""
    minutes = list(range(first_minute, first_minute + count))
    reads = plan_reads(keys, cells, minutes)
    with client.pipeline(transaction=False) as pipe:
        for read in reads:
            pipe.hmget(read.key, read.fields)
        replies = pipe.execute()
    totals = dict.fromkeys(minutes, 0.0)
    for cell in parse_reads(reads, replies).values():
        for m, (r, _) in cell.items():
            totals[m] += r
    return [totals[m] for m in minutes]
