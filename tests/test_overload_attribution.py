"""Per-tenant attribution of the load level: one tenant flooding within its quota is held
back at the level it causes, and nobody else is deferred; many tenants over their shares
(a genuine overload) still raise the deployment's level.  Pure tables, then the real
producer and controller on Redis."""

from __future__ import annotations

import pytest

from gateway_tasks.core.errors import Deferred
from gateway_tasks.core.settings import Overload
from gateway_tasks.overload.attribution import Held, TenantDemand, attribute, fair_share, hold_tenants
from gateway_tasks.overload.controller import OverloadController
from gateway_tasks.overload.levels import Signals, target_level
from gateway_tasks.overload.state import read_held, read_state
from gateway_tasks.overload.status import deployment_status, format_status

O = Overload()
CAP = {"p": 100_000.0}       # tokens over the window: 600k TPM x 10 s
MAX_WAIT = {"vip": 2_000, "normal": 30_000, "batch": 300_000}
SHARES = {"vip": 70.0, "normal": 20.0, "batch": 10.0}


@pytest.mark.parametrize("tier, present, expected", [
    ("vip", {"vip": 1}, 0.7),                        # alone, still its tier's share
    ("vip", {"vip": 2, "batch": 1}, 0.35),
    ("batch", {"vip": 1, "batch": 2}, 0.05),
    ("normal", {"vip": 2, "normal": 4, "batch": 4}, 0.2 / 4),
    ("normal", {"vip": 1}, 0.0),                     # not there: no share
])
def test_fair_share_table(tier, present, expected):
    assert fair_share(tier, present, SHARES) == pytest.approx(expected)


FLOOD = Signals(utilisation={"p": 0.97}, backlog_s={"p": 600.0}, queue_depth=450,
                oldest_wait_ms={"vip": 9_000.0}, wait_ms={"vip": 4_000.0})


def flood_demand(victim_tokens: float = 3_000.0) -> list[TenantDemand]:
    return [TenantDemand("whale", "p", "vip", 50 * 120_000.0, queued=450, in_flight=50, oldest_wait_ms=9_000.0),
            TenantDemand("small", "p", "batch", victim_tokens, queued=1, in_flight=1, oldest_wait_ms=100.0)]


def test_one_tenant_over_its_share_is_held_and_the_deployment_is_not():
    assert target_level(FLOOD, O, MAX_WAIT)[0] == 3
    got = attribute(FLOOD, flood_demand(), O, MAX_WAIT, SHARES, {"p": {"vip": 1, "batch": 1}}, CAP)
    assert got.asked == 3 and got.level == 0, got.reason
    assert set(got.held) == {"whale"} and got.held["whale"].level == 3
    assert "whale (vip) asks for 6000% of pool p's capacity over the window (100% of its demand), " \
           "over its fair share of 70%" in got.held["whale"].reason
    assert "without holding back 1 tenant over its fair share" in got.reason and "whale" not in got.reason


def test_many_tenants_over_their_shares_are_a_genuine_overload():
    """12 tenants, each asking for the same part of the pool (over its fair share): holding
    back any 3 of them leaves most of the demand, so the deployment's level stands."""
    demand = [TenantDemand(f"{tier}{i}", "p", tier, 10_000.0, queued=20, in_flight=2)
              for tier in ("vip", "normal", "batch") for i in range(4)]
    signals = Signals(utilisation={"p": 1.0}, backlog_s={"p": 30.0}, wait_ms={"normal": 40_000.0})
    got = attribute(signals, demand, O, MAX_WAIT, SHARES, {"p": {"vip": 4, "normal": 4, "batch": 4}}, CAP)
    assert got.level == got.asked == 3 and got.held == {}


def test_two_flooders_are_held_together_when_allowed_and_off_is_off():
    demand = [*flood_demand(), TenantDemand("whale2", "p", "vip", 50 * 120_000.0, queued=450, in_flight=50,
                                            oldest_wait_ms=8_000.0)]
    present = {"p": {"vip": 2, "batch": 1}}
    two = Overload(held_tenants_max=2)
    got = attribute(FLOOD, demand, two, MAX_WAIT, SHARES, present, CAP)
    assert got.level == 0 and set(got.held) == {"whale", "whale2"}
    # by default one tenant at most: neither holds most of the demand alone
    assert attribute(FLOOD, demand, O, MAX_WAIT, SHARES, present, CAP).held == {}
    off = attribute(FLOOD, demand, Overload(held_tenants_max=0), MAX_WAIT, SHARES, present, CAP)
    assert off.level == 3 and off.held == {}


def test_the_others_own_pressure_still_counts():
    """Without the whale's excess, the small tenant's own old task still asks for L3."""
    signals = Signals(utilisation={"p": 0.97}, oldest_wait_ms={"batch": 400_000.0})
    demand = [TenantDemand("whale", "p", "vip", 6e6, queued=450, in_flight=50),
              TenantDemand("small", "p", "batch", 3_000.0, queued=5, in_flight=1, oldest_wait_ms=400_000.0)]
    got = attribute(signals, demand, O, MAX_WAIT, SHARES, {"p": {"vip": 1, "batch": 1}}, CAP)
    assert got.level == 3 and got.held == {}


def test_a_small_tenant_is_never_over_its_share():
    """Two vip tenants, one tiny task each, the older waiting past vip's max wait: a slow
    tier, not a tenant's excess -- the level stands."""
    signals = Signals(oldest_wait_ms={"vip": 4_000.0})
    demand = [TenantDemand("t0", "p", "vip", 10.0, queued=1, oldest_wait_ms=500.0),
              TenantDemand("t1", "p", "vip", 10.0, queued=1, oldest_wait_ms=4_000.0)]
    got = attribute(signals, demand, O, MAX_WAIT, SHARES, {"p": {"vip": 2}}, CAP)
    assert got.level == 3 and got.held == {}


def test_hold_tenants_keeps_a_hold_time():
    now = 100_000
    held = hold_tenants({}, {"a": Held(3, 0, "why")}, now, 30_000)
    assert held == {"a": Held(3, now + 30_000, "why")}
    later = hold_tenants(held, {}, now + 10_000, 30_000)            # not held this tick: kept
    assert later["a"].level == 3
    assert hold_tenants(later, {}, now + 31_000, 30_000) == {}       # its hold ran out
    both = hold_tenants(held, {"a": Held(2, 0, "less")}, now + 1_000, 30_000)
    assert both["a"].level == 3 and both["a"].until_ms == now + 31_000


def test_a_vip_flood_within_quota_defers_no_other_tenant(make_gateway, settings):
    """500 vip tasks with max_tokens=120000 from one tenant (its hourly quota, the last after the tick):
    the controller holds that tenant at L3 and keeps the deployment below the level that
    defers batch -- another batch tenant's submit is taken; with attribution off, the same
    queue raises the deployment to L3 and defers it."""
    def flooded(overload: Overload, suffix: str):
        s = settings.with_(key_prefix=settings.key_prefix + suffix, overload=overload)
        gw = make_gateway([("whale", "vip"), ("small", "batch")], settings=s)
        for i in range(499):
            gw.submit("whale", f"summarise report {i}", max_tokens=120_000)
        return gw, OverloadController(gw.r, s).tick()

    gw, decision = flooded(Overload(), "on:")
    assert decision.level < 3, decision.reason
    held = read_held(gw.r, gw.keys)
    assert set(held) == {"whale"} and held["whale"]["level"] == 3
    assert "without holding back 1 tenant" in read_state(gw.r, gw.keys).reason
    assert "whale" not in str(deployment_status(gw.r, gw.settings, tenant_id="small"))   # no other tenant's id
    assert deployment_status(gw.r, gw.settings, tenant_id="whale")["held"]["whale"]["level"] == 3
    assert "held tenants" in format_status(deployment_status(gw.r, gw.settings))
    gw.submit("small", "a small batch job", max_tokens=50)          # not deferred
    gw.submit("whale", "one more", max_tokens=120_000)              # vip: never deferred; it queues

    gw_off, decision_off = flooded(Overload(held_tenants_max=0), "off:")
    assert decision_off.level == 3
    with pytest.raises(Deferred):
        gw_off.submit("small", "a small batch job", max_tokens=50, on_defer="refuse")
    for g in (gw, gw_off):
        for k in g.r.scan_iter(match=f"{g.settings.key_prefix}*"):
            g.r.delete(k)


def test_a_held_batch_flooder_is_deferred_itself(make_gateway, settings):
    """A batch tenant holding the pool's queue is held at the level it causes: its own new
    work is deferred (batch defers from L3), a normal tenant's is not."""
    gw = make_gateway([("bulk", "batch"), ("pro", "normal")], settings=settings)
    pool = settings.pools[0]
    from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
    for i in range(300):       # as if submitted: 300 x 20k tokens, 2 startable at a time
        enqueue(gw.r, EnqueueCall(gw.keys, settings.tier("batch"), pool.name, tenant="bulk", tag=f"t{i}",
                                  est_tokens=200_000, message_json="{}"))
    gw.submit("pro", "hello", max_tokens=20)
    decision = OverloadController(gw.r, settings).tick()
    assert decision.level < 3, decision.reason
    assert read_held(gw.r, gw.keys)["bulk"]["level"] == 3
    with pytest.raises(Deferred, match="bulk"):
        gw.submit("bulk", "more", max_tokens=20, on_defer="refuse")
    gw.submit("pro", "still taken", max_tokens=20)
