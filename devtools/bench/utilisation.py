"""How much of an upstream's TPM a window really used, from the simulator's own
``/stats`` taken at the window's two ends.

Counting the tokens of the requests that *completed* in a window and dividing
by ``tpm / 60 * seconds`` (``bench.load.served_in_window``) is right only when
the token bucket holds as much at the end as at the start.  It does not:

* the bucket holds ``burst_s`` seconds of quota.  Spent inside the window
  (a full bucket at the start: a new run, a pause before the window) it counts
  up to ``burst_s / seconds`` too much; refilled inside it (the window ends
  after a lull, the dispatcher fell behind) it counts that much too little --
  the bucket saved quota that the next window will spend;
* under ``charge="reserve"`` a request holds ``prompt + max_tokens`` of the
  bucket from admission to completion, so requests in flight at one end of
  the window were paid for in one window and are counted in the other.

The simulator's bucket obeys, over any window of T seconds at R tokens/s:

    level_end = level_start + R*T - wasted - (served + held_end - held_start)

(``served``: prompt + completion of the requests completed in the window,
``held``: tokens held by requests in flight, ``wasted``: refill lost at a full
bucket).  So the quota the window really used is

    used = served + (held_end - held_start) - (level_start - level_end) = R*T - wasted

and ``utilisation = used / (R*T)``: 100 % exactly when the bucket never
overflowed, whatever it held at either end.  ``wasted`` is read too, as a
check of the identity (they agree to rounding).  Tokens a window banked in
the bucket (a negative drawdown) count as not lost -- they stay spendable;
the drawdown is printed beside the figure, so a window that ended on a stall
shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class UpstreamPoint:
    """The simulator's token accounting at one instant (its CLOCK_MONOTONIC)."""

    monotonic_s: float
    served_tokens: int        # prompt + completion of every completed request so far
    level_tokens: float       # the token bucket's level (negative while in debt)
    held_tokens: int          # held by requests in flight (charge="reserve")
    wasted_tokens: float      # refill lost at a full bucket so far

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> "UpstreamPoint":
        """From a ``/stats`` document (the simulator's ``stats()``)."""
        return cls(monotonic_s=float(stats["now_monotonic"]),
                   served_tokens=int(stats["tokens_prompt"]) + int(stats["tokens_completion"]),
                   level_tokens=float(stats["tokens_level"]),
                   held_tokens=int(stats["tokens_held"]),
                   wasted_tokens=float(stats["tokens_wasted"]))


def _pct(part: float, whole: float) -> float | None:
    return round(100.0 * part / whole, 2) if whole > 0 else None


def window_utilisation(start: UpstreamPoint, end: UpstreamPoint,
                       tokens_per_s: float) -> dict[str, Any]:
    """The quota a window used, and the naive figure beside it (module docstring)."""
    window_s = end.monotonic_s - start.monotonic_s
    quota = tokens_per_s * window_s
    served = end.served_tokens - start.served_tokens
    drawdown = start.level_tokens - end.level_tokens          # > 0: the window spent saved burst
    held_change = end.held_tokens - start.held_tokens          # > 0: paid now, served later
    used = served + held_change - drawdown
    wasted = end.wasted_tokens - start.wasted_tokens
    return {
        "window_s": round(window_s, 3),
        "quota_tokens": round(quota),
        "served_tokens": served,
        "bucket_drawdown_tokens": round(drawdown),
        "held_change_tokens": held_change,
        "used_tokens": round(used),
        "wasted_tokens": round(wasted),
        "served_pct": _pct(served, quota),                  # the naive figure
        "utilisation_pct": _pct(used, quota),               # the honest one
        "unwasted_pct": _pct(quota - wasted, quota),        # the same, from the waste counter
    }
