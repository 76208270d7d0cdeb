"""The storm benchmark's measures, pure: upstream rate per second, latency
percentiles, deferred tasks and the targets (``gateway-dev cron-bench --storm``)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from devtools.bench.targets import at_most
from devtools.measure import percentile

DEFERRED_WAIT_MS = 1000           # a task the gateway held in its queue this long was deferred
TARGET_PEAK_OVER_MEAN = 1.25
TARGET_429_PCT = 0.3
TARGET_VIP_P99_RATIO = 1.5        # "unchanged": p99 during the storm <= 1.5 x p99 just before it


def window_series(first_second: int, per_second: Sequence[int], start_mono: float,
                  end_mono: float) -> list[int]:
    """The whole monotonic seconds of a per-second series covering [start, end]."""
    lo, hi = int(math.floor(start_mono)), int(math.floor(end_mono))
    return [per_second[s - first_second] if 0 <= s - first_second < len(per_second) else 0
            for s in range(lo, hi + 1)]


def rebin(series: Sequence[int], bin_s: int) -> list[int]:
    """Sums of consecutive ``bin_s``-second groups (a short last group is dropped,
    unless it is the only one)."""
    full = [sum(series[i:i + bin_s]) for i in range(0, len(series) - bin_s + 1, bin_s)]
    return full or ([sum(series)] if series else [])


def rate_stats(series: Sequence[int], bin_s: int = 1) -> dict[str, Any]:
    """Peak and mean requests/s of a per-second series in ``bin_s`` bins, and their ratio."""
    bins = rebin(series, bin_s)
    if not bins or sum(bins) == 0:
        return {"bin_s": bin_s, "peak_per_s": 0.0, "mean_per_s": 0.0, "peak_over_mean": None}
    peak = max(bins) / bin_s
    mean = sum(bins) / (len(bins) * bin_s)
    return {"bin_s": bin_s, "peak_per_s": round(peak, 2), "mean_per_s": round(mean, 2),
            "peak_over_mean": round(peak / mean, 3)}


def latency_stats(values_ms: Sequence[float], missing: int = 0) -> dict[str, Any]:
    """p50/p99/max of latencies; ``missing`` tasks that never finished count as infinite."""
    values = list(values_ms) + [math.inf] * missing
    out: dict[str, Any] = {"count": len(values_ms), "missing": missing}
    for name, q in (("p50_ms", 50), ("p99_ms", 99)):
        v = percentile(values, q, default=math.nan)
        out[name] = None if math.isinf(v) or math.isnan(v) else round(v, 1)
    out["max_ms"] = round(max(values_ms), 1) if values_ms and not missing else None
    return out


def deferred(queue_waits_ms: Sequence[float], threshold_ms: float = DEFERRED_WAIT_MS) -> int:
    """Tasks the gateway held back (queue wait >= threshold) instead of sending them at once."""
    return sum(1 for w in queue_waits_ms if w >= threshold_ms)


def rate_429_pct(ok: int, rejected: int, errors: int = 0) -> float:
    answered = ok + rejected + errors
    return round(100.0 * rejected / answered, 4) if answered else 0.0


def vip_p99_ratio(quiet_p99_ms: float | None, storm_p99_ms: float | None) -> float | None:
    if quiet_p99_ms is None or storm_p99_ms is None or quiet_p99_ms <= 0:
        return None
    return round(storm_p99_ms / quiet_p99_ms, 3)


def level_changes(history: Sequence[dict[str, Any]], boundary_ms: int) -> list[dict[str, Any]]:
    """The load level's changes (``read_history``: oldest first, JSON ``{ts_ms, from, to,
    reason}``) as seconds from the storm's boundary B, malformed entries left out."""
    out = []
    for change in history:
        try:
            at_s = round((int(change["ts_ms"]) - boundary_ms) / 1000.0, 1)
            out.append({"at_s": at_s, "from": int(change["from"]), "to": int(change["to"]),
                        "reason": str(change.get("reason", ""))})
        except (KeyError, TypeError, ValueError):
            continue
    return out


def first_reached_s(changes: Sequence[dict[str, Any]], level: int) -> float | None:
    """Seconds from B to the first change at or after B that put the level at ``level`` or
    above (None: it never got there during the storm)."""
    return next((c["at_s"] for c in changes if c["at_s"] >= 0 and c["to"] >= level), None)


def targets(jitter_on: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, judged on the jitter-on run."""
    up = jitter_on["upstream"]
    probe = jitter_on["vip_probe"]
    return [
        at_most("peak_over_mean", up["rate"]["peak_over_mean"], TARGET_PEAK_OVER_MEAN,
                f"upstream requests/s peak/mean with jitter on <= {TARGET_PEAK_OVER_MEAN} "
                f"(1 s bins): {up['rate']['peak_over_mean']}"),
        at_most("rate_429_pct", up["rate_429_pct"], TARGET_429_PCT,
                f"upstream 429s with jitter on <= {TARGET_429_PCT} %: {up['rate_429_pct']} %"),
        at_most("vip_p99_ratio", probe["p99_ratio"], TARGET_VIP_P99_RATIO,
                f"VIP p99 unchanged by the storm (storm / quiet <= {TARGET_VIP_P99_RATIO}): "
                f"{probe['storm']['p99_ms']} ms vs {probe['quiet']['p99_ms']} ms "
                f"= {probe['p99_ratio']}"),
    ]
