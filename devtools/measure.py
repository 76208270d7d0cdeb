"""Small statistics shared by the demo and the benchmarks."""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Sequence


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


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of several runs' values (at least one).

    ``None`` counts as unbounded (+infinity: e.g. a wait of tasks never
    dispatched) and an unbounded result is ``None`` again, so the output is JSON.
    """
    if not values:
        raise ValueError("spread of no values")
    ordered = sorted(math.inf if v is None else float(v) for v in values)
    return {"median": _bounded(statistics.median(ordered)), "min": _bounded(ordered[0]),
            "max": _bounded(ordered[-1]), "runs": len(ordered)}


def _bounded(value: float) -> float | None:
    return None if math.isinf(value) else round(value, 4)
