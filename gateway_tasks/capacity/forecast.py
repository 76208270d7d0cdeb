"""The cron demand forecast as data: per (pool, tier), runs and estimated tokens in
consecutive time bins from ``start_ms``; its JSON form is what the leader beat
publishes at ``Keys.cron_forecast`` and what the metrics exporter reads.

``beat.forecast`` computes it from the schedule.  Pure: no clock, no Redis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway_tasks.core.errors import ConfigError


def bin_of(fire_ms: int, start_ms: int, bucket_s: int) -> int:
    """The bin of a fire time; runs already due (before ``start_ms``) are bin 0."""
    return max(0, (fire_ms - start_ms) // (bucket_s * 1000))



@dataclass
class Series:
    runs: list[int]
    tokens: list[int]


@dataclass
class Forecast:
    start_ms: int
    bucket_s: int
    buckets: int
    series: dict[tuple[str, str], Series] = field(default_factory=dict)     # (pool, tier) ->
    entries_read: int = 0
    generated_ms: int = 0

    @property
    def end_ms(self) -> int:
        return self.start_ms + self.bucket_s * self.buckets * 1000

    def add(self, pool: str, tier: str, fire_ms: int, tokens: int) -> None:
        cell = self.series.get((pool, tier))
        if cell is None:
            cell = self.series[(pool, tier)] = Series([0] * self.buckets, [0] * self.buckets)
        i = bin_of(fire_ms, self.start_ms, self.bucket_s)
        if i < self.buckets:
            cell.runs[i] += 1
            cell.tokens[i] += tokens

    def pool_tokens(self, pool: str) -> list[int]:
        out = [0] * self.buckets
        for (p, _), s in self.series.items():
            if p == pool:
                out = [a + b for a, b in zip(out, s.tokens)]
        return out

    def to_json(self) -> str:
        return json.dumps({
            "generated_ms": self.generated_ms, "start_ms": self.start_ms, "bucket_s": self.bucket_s,
            "buckets": self.buckets, "entries_read": self.entries_read,
            "series": [{"pool": p, "tier": t, "runs": s.runs, "tokens": s.tokens}
                       for (p, t), s in sorted(self.series.items())]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Forecast":
        d = json.loads(text)
        fc = cls(int(d["start_ms"]), int(d["bucket_s"]), int(d["buckets"]),
                 entries_read=int(d.get("entries_read", 0)), generated_ms=int(d.get("generated_ms", 0)))
        for s in d["series"]:
            fc.series[(s["pool"], s["tier"])] = Series([int(x) for x in s["runs"]],
                                                      [int(x) for x in s["tokens"]])
        return fc


def validate_window(horizon_s: int, bucket_s: int) -> int:
    """The number of bins; ConfigError for a bad horizon or bin size."""
    if not isinstance(bucket_s, int) or bucket_s <= 0:
        raise ConfigError(f"forecast bucket_s={bucket_s!r} is invalid; expected a positive integer")
    if not isinstance(horizon_s, int) or horizon_s < bucket_s or horizon_s % bucket_s:
        raise ConfigError(f"forecast horizon_s={horizon_s!r} is invalid; expected a positive "
                          f"multiple of bucket_s={bucket_s}")
    return horizon_s // bucket_s
