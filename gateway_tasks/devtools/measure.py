"""Small statistics shared by the demo and the benchmarks."""

from __future__ import annotations

from typing import Mapping, Sequence


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


def counter_delta(before: Mapping[str, int], after: Mapping[str, int], name: str) -> int:
    """How much counter ``name`` grew between two snapshots (a missing one counts as 0)."""
    return after.get(name, 0) - before.get(name, 0)
