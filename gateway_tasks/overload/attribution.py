"""Who causes the pressure: per-tenant attribution of the load level, as pure functions (no
I/O, table-tested in tests/test_overload_attribution.py).

The load level (gateway_tasks/overload/levels.py) is the deployment's answer to an overloaded
pool.  A tenant that asks a pool for more than its fair share -- a VIP tenant queueing 500
large tasks, all within its quotas -- would raise it alone, and every other tenant would be
deferred or degraded for it.  So each tick the controller also reads each tenant's demand on
each pool (``TenantDemand``: its tasks in flight and those of its queue it can start within
the window, in estimated tokens) and ``attribute`` asks:

* which tenants are over their fair share of a pool: their demand over the window above the
  part of the pool's capacity the tier shares give them (``fair_share``: the tier's share,
  split evenly among the tier's tenants there) -- a tenant alone on a pool still has only
  its tier's share: the others' is theirs when they come;
* whether a few of them (at most ``Overload.held_tenants_max``, largest excess first) hold
  most of a pool's demand (``Overload.held_demand_share``) and, their demand taken out of
  the signals (``without``: the signals the other tenants make), the level falls.

If so, the deployment's level is the one the other tenants cause, and those tenants are
*held* at the level they alone ask for: their own new work sees that level's actions (the
producer applies max(deployment level, tenant's held level)), while their queued work
waits behind their concurrency cap in fair order.  Many tenants together over their
shares (a genuine overload) move no level down: removing a few of them changes nothing.
A held tenant stays held for ``Overload.hold_s`` after the last tick that held it, as the
level itself does (``hold_tenants``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from gateway_tasks.core.settings import Overload
from gateway_tasks.overload.levels import Signals, target_level


@dataclass(frozen=True)
class TenantDemand:
    """One tenant's demand on one pool over the next window, as a tick reads it."""

    tenant: str
    pool: str
    tier: str                  # "" when unknown (only in flight: it counts, it is not judged)
    tokens: float              # estimated tokens of its tasks in flight and startable
    queued: float = 0.0        # its queued tasks (estimated from the queue's sample)
    in_flight: int = 0
    oldest_wait_ms: float = 0.0   # its oldest queued task's age (0: unknown / none)


@dataclass(frozen=True)
class Excess:
    tenant: str
    pool: str
    tier: str
    share: float               # its part of the pool's demand
    use: float                 # its demand / the pool's capacity over the window
    fair: float                # its fair share of that capacity
    queued: float
    in_flight: int

    @property
    def over(self) -> float:
        return max(0.0, self.use - self.fair)


@dataclass(frozen=True)
class Held:
    """A tenant held back: the level its own new work sees, until when, and why."""

    level: int
    until_ms: int
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"level": self.level, "until_ms": self.until_ms, "reason": self.reason}


@dataclass(frozen=True)
class Attribution:
    level: int                 # the deployment's target level, held tenants' demand left out
    reason: str
    held: dict[str, Held] = field(default_factory=dict)   # tenants held this tick (until_ms 0)
    asked: int = 0             # the level every signal together asks for


def fair_share(tier: str, tenants_per_tier: Mapping[str, int], tier_shares: Mapping[str, float]) -> float:
    """A tenant's fair share of a pool's capacity: its tier's share (of every tier's: the
    other tiers' shares wait for their tenants, as the fair pick keeps them), split evenly
    among the tier's tenants there (0 for an unknown tier)."""
    total = sum(v for v in tier_shares.values() if v > 0)
    n = tenants_per_tier.get(tier, 0)
    if total <= 0 or n <= 0 or tier_shares.get(tier, 0) <= 0:
        return 0.0
    return tier_shares[tier] / total / n


def excesses(demand: Sequence[TenantDemand], tier_shares: Mapping[str, float],
             tenants_per_tier: Mapping[str, Mapping[str, int]], capacity: Mapping[str, float]) -> list[Excess]:
    """Every judged tenant's part of each pool's demand, its use of the pool's capacity over
    the window (``capacity``: pool -> tokens) and its fair share of it (pools with no demand
    or capacity left out).  ``tenants_per_tier``: pool -> tier -> tenants there (at least
    those in ``demand``)."""
    totals: dict[str, float] = {}
    seen: dict[str, dict[str, int]] = {}
    for d in demand:
        totals[d.pool] = totals.get(d.pool, 0.0) + d.tokens
        if d.tier:
            seen.setdefault(d.pool, {}).setdefault(d.tier, 0)
            seen[d.pool][d.tier] += 1
    out = []
    for d in demand:
        cap = capacity.get(d.pool, 0.0)
        if not d.tier or totals[d.pool] <= 0 or cap <= 0:
            continue
        counts = dict(tenants_per_tier.get(d.pool) or {})
        for t, n in seen[d.pool].items():
            counts[t] = max(n, counts.get(t, 0))
        out.append(Excess(d.tenant, d.pool, d.tier, d.tokens / totals[d.pool], d.tokens / cap,
                          fair_share(d.tier, counts, tier_shares), d.queued, d.in_flight))
    return out


def without(signals: Signals, held: Sequence[Excess], demand: Sequence[TenantDemand]) -> Signals:
    """The signals as the other tenants make them, the held tenants' demand taken out: a
    pool's utilisation and backlog lose the held tenants' part of its demand, the queue depth
    their queued tasks, a tier's oldest wait is the oldest among the other tenants, and the
    mean dispatch wait of a held tenant's tier is not judged."""
    names = {e.tenant for e in held}
    theirs: dict[str, float] = {}
    for e in held:
        theirs[e.pool] = min(1.0, theirs.get(e.pool, 0.0) + e.share)
    util = {p: round(u * (1.0 - theirs.get(p, 0.0)), 4) for p, u in signals.utilisation.items()}
    backlog = {p: round(b * (1.0 - theirs.get(p, 0.0)), 2) for p, b in signals.backlog_s.items()}
    depth = signals.queue_depth - sum(e.queued for e in held)
    oldest: dict[str, float] = {}
    for tier in signals.oldest_wait_ms:
        ages = [d.oldest_wait_ms for d in demand
                if d.tier == tier and d.tenant not in names and d.oldest_wait_ms > 0]
        if ages:
            oldest[tier] = max(ages)
    # a tier's mean dispatch wait is not split by tenant: the held tenants' own long waits
    # (behind their cap and the bucket) would stand for the tier's, so it is not judged in
    # their tiers -- the other tenants' waits are still judged there, by their oldest tasks
    held_tiers = {e.tier for e in held}
    waits = {tier: (None if tier in held_tiers else wait) for tier, wait in signals.wait_ms.items()}
    return replace(signals, utilisation=util, backlog_s=backlog, queue_depth=max(0, int(round(depth))),
                   oldest_wait_ms=oldest, wait_ms=waits)


def attribute(signals: Signals, demand: Sequence[TenantDemand], overload: Overload,
              max_wait_ms: Mapping[str, float], tier_shares: Mapping[str, float],
              tenants_per_tier: Mapping[str, Mapping[str, int]], capacity: Mapping[str, float]) -> Attribution:
    """The deployment's target level with the few tenants that cause it held back (see the
    module's docstring); nobody held when the level does not fall without them."""
    asked, reason = target_level(signals, overload, max_wait_ms)
    if asked == 0 or overload.held_tenants_max <= 0:
        return Attribution(asked, reason, {}, asked)
    over = sorted((e for e in excesses(demand, tier_shares, tenants_per_tier, capacity) if e.over > 0),
                  key=lambda e: (-e.over, e.tenant))
    candidates: list[str] = []
    for e in over:
        if e.tenant not in candidates:
            candidates.append(e.tenant)
    for k in range(1, min(overload.held_tenants_max, len(candidates)) + 1):
        names = set(candidates[:k])
        held = [e for e in over if e.tenant in names]
        shares: dict[str, float] = {}
        for e in held:
            shares[e.pool] = shares.get(e.pool, 0.0) + e.share
        if max(shares.values()) < overload.held_demand_share:
            continue          # not most of any pool's demand: a genuine overload, not theirs
        level, why = target_level(without(signals, held, demand), overload, max_wait_ms)
        if level >= asked:
            continue
        out = {}
        for name in candidates[:k]:
            e = max((x for x in held if x.tenant == name), key=lambda x: x.over)
            out[name] = Held(asked, 0, f"tenant {name} ({e.tier}) asks for {e.use:.0%} of pool "
                                       f"{e.pool}'s capacity over the window ({e.share:.0%} of its "
                                       f"demand), over its fair share of {e.fair:.0%}: held at "
                                       f"L{asked} ({reason})")
        # the deployment's reason is read by every tenant: it names no tenant
        held_text = "1 tenant" if k == 1 else f"{k} tenants"
        return Attribution(level, f"{why} (L{asked} without holding back {held_text} over its fair share)",
                           out, asked)
    return Attribution(asked, reason, {}, asked)


def hold_tenants(previous: Mapping[str, Held], now: Mapping[str, Held], now_ms: int,
                 hold_ms: int) -> dict[str, Held]:
    """The tenants held in force: those held this tick (until now + hold), and those held
    before whose hold has not run out (at the higher of the two levels while both hold)."""
    out = {name: h for name, h in previous.items() if h.until_ms > now_ms}
    for name, h in now.items():
        level = max(h.level, out[name].level) if name in out else h.level
        out[name] = Held(level, now_ms + hold_ms, h.reason)
    return out
