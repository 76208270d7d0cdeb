"""Between tiers: the aging presets of the ``aging`` policy and the deadline boost's lift
across tiers -- the score maths as pure functions; lua/dispatch/pick/scoring.lua applies
them (the router passes each tier's terms in pick.lua's ARGV).

**Aging presets** (``Settings.aging``; policy ``aging``: the largest score goes first):

* ``linear`` -- score = ``Tier.base_weight`` + ``Tier.aging_alpha_per_ms`` x wait (ms), without
  bound: VIP 100 / normal 20 / batch 1 with alpha 0.05 / 0.02 / 0.005 (the aging weighted
  scheduler's formula).  A batch task that waited 19.8 s outranks a fresh VIP one.
* ``capped`` -- the multi-level priority queue's constants: each tier a band 1000 apart by
  rank (the tier with the largest base weight first: VIP 0, normal 1000, batch 2000, lower
  is better), and waiting lifts a task by 100 per 60 s, at most 800.  Bands never cross: an
  aged batch task (2000 - 800) still goes after a fresh normal one (1000); aging orders the
  waits inside a band and lets an old task of a lower band catch up with part of the gap.
  As a score (larger first): -band + min(wait_ms x 100 / 60000, 800).

Both are one formula in Lua -- ``weight + min(alpha_per_ms x wait_ms, cap)`` (cap < 0: none) --
with the preset's terms (``aging_terms``).

**Deadline boost across tiers** (``Settings.deadline_boost_across_tiers``): a task
within ``Settings.deadline_boost_s`` of its deadline is taken ahead of its own tier's fair
order (lua/dispatch/deadline.lua) and, across tiers, competes at its tier's band lowered by
1500, never below 0 (the multi-level priority queue's rule): an urgent normal task at 0
(VIP's band: the older first), an urgent batch task at 500 (after VIP work, before normal).
``priorities`` gives each tier's band and its urgent band (``NOT_LIFTED``: it stays in its tier).
"""

from __future__ import annotations

from typing import Iterable, Mapping

from gateway_tasks.core.settings import AGING_PRESETS, Tier

BAND_STEP = 1000                 # the bands of the capped preset and the lift, by tier rank
URGENT_LIFT = 1500               # an urgent task's band: its tier's band less this, >= 0
CAPPED_BONUS_PER_MS = 100 / 60_000   # +100 per 60 s waited ...
CAPPED_BONUS_MAX = 800.0             # ... at most
NO_CAP = -1.0
NOT_LIFTED = -1


def bands(weights: Mapping[str, float]) -> dict[str, int]:
    """Each tier's band: BAND_STEP x its rank by base weight, heaviest first (equal weights
    share a rank)."""
    ranked = sorted(set(weights.values()), reverse=True)
    return {name: BAND_STEP * ranked.index(w) for name, w in weights.items()}


def urgent_band(band: int) -> int:
    """An urgent task's band across tiers: its tier's less URGENT_LIFT, never below 0."""
    return max(0, band - URGENT_LIFT)


def priorities(weights: Mapping[str, float], across_tiers: bool) -> dict[str, tuple[int, int]]:
    """Per tier: (its band, its urgent tasks' band or NOT_LIFTED) -- lower goes first."""
    return {name: (b, urgent_band(b) if across_tiers else NOT_LIFTED) for name, b in bands(weights).items()}


def aging_terms(preset: str, base_weight: float, alpha_per_ms: float, band: int) -> tuple[float, float, float]:
    """(weight, alpha_per_ms, cap) of a tier under an aging preset (cap NO_CAP: none)."""
    if preset == "linear":
        return float(base_weight), float(alpha_per_ms), NO_CAP
    if preset == "capped":
        return float(-band), CAPPED_BONUS_PER_MS, CAPPED_BONUS_MAX
    raise ValueError(f"unknown aging preset {preset!r}; expected one of {AGING_PRESETS}")


def aging_score(weight: float, alpha_per_ms: float, cap: float, wait_ms: float) -> float:
    """The aging policy's score of a task that waited wait_ms (larger first).  Mirrors
    lua/dispatch/pick/scoring.lua."""
    bonus = alpha_per_ms * max(0.0, wait_ms)
    return weight + (bonus if cap < 0 else min(bonus, cap))


def tier_weights(tiers: Iterable[Tier]) -> dict[str, float]:
    """name -> base_weight of the settings' tiers."""
    return {t.name: float(t.base_weight) for t in tiers}
