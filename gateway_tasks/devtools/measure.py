"""Small statistics shared by the demo and the benchmarks."""

from __future__ import annotations

from typing import Sequence


def percentile(values: Sequence[float], q: float, default: float | None = None) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``.

    No values gives ``default``, or raises ValueError when there is none.
    """
    if not values:
        if default is None:
            raise ValueError("percentile of no values")
        return default
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]
