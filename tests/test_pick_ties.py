"""Equal start tags inside a tier go in arrival order, never by tenant id
(lua/core/prelude.lua gt_tie, gateway_tasks/dispatch/lanes.py "Ties"): lua/dispatch/pick.lua
against a real Redis, through the router API, with ids that sort against their arrival."""

from __future__ import annotations

import pytest

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Settings
from gateway_tasks.dispatch.lanes import TIE_BITS, active_score, start_tag, tie
from gateway_tasks.dispatch.router import PickPlan, Picked
from tests.test_router import BIG, pick, push

EST = 100


def plan_of(settings: Settings) -> tuple[Settings, PickPlan]:
    s = settings.with_(policy="wfq", pools=(BIG,))
    return s, PickPlan(s, [s.queue_name("normal", "default")])


def served(r, plan: PickPlan, n: int) -> list[str]:
    out = []
    for _ in range(n):
        got = pick(r, plan)
        assert isinstance(got, Picked), got
        out.append(got.tenant)
    return out


def test_equal_tags_are_served_in_arrival_order_not_by_id(r, settings):
    # 240 newcomers all join at the tier's virtual time 0; each id sorts before the one that
    # came before it (ties by member name would serve them exactly backwards)
    s, plan = plan_of(settings)
    arrivals = [f"t-{999 - i:03d}" for i in range(240)]
    for tenant in arrivals:
        push(r, s, "normal", est=EST, tenant=tenant)
    assert served(r, plan, len(arrivals)) == arrivals


def test_a_newcomer_at_the_virtual_time_goes_behind_tenants_already_waiting_there(r, settings):
    # the shape: the tier serves a tie group at virtual time V while newcomers with
    # early-sorting ids keep joining at V -- they go behind, and nobody waits for ever
    s, plan = plan_of(settings)
    waiting = [f"zz-{i:03d}" for i in range(100)]
    for tenant in waiting:
        push(r, s, "normal", est=EST, tenant=tenant)
    first = served(r, plan, 10)
    assert first == waiting[:10]
    newcomers = [f"aa-{i:03d}" for i in range(100)]
    for tenant in newcomers:
        push(r, s, "normal", est=EST, tenant=tenant)
    assert served(r, plan, 190) == waiting[10:] + newcomers


def test_a_tag_given_at_dispatch_and_a_newcomer_at_that_tag_go_in_the_order_they_took_it(r, settings):
    # 'a' and 'y' are served at tag 0 and queue their next tasks at their finish tag EST, in
    # that order; serving 'a' there moves the virtual time to EST; newcomer 'b' then takes
    # tag EST too, after 'y' did: 'y' first, whatever the ids
    s, plan = plan_of(settings)
    for tenant in ("zzz-a", "zzz-a", "mmm-y", "mmm-y"):
        push(r, s, "normal", est=EST, tenant=tenant)
    assert served(r, plan, 3) == ["zzz-a", "mmm-y", "zzz-a"]
    push(r, s, "normal", est=EST, tenant="aaa-b")
    assert served(r, plan, 2) == ["mmm-y", "aaa-b"]


def test_a_tenant_back_at_its_finish_tag_keeps_the_place_it_took_there(r, settings):
    # 'a' runs dry after its task at tag 0: its finish tag EST is kept with its place there,
    # taken before 'y' and 'w' took EST; when 'a' sends again it is back at EST ahead of them
    s, plan = plan_of(settings)
    for tenant in ("zzz-a", "mmm-y", "mmm-y", "aaa-w", "aaa-w"):
        push(r, s, "normal", est=EST, tenant=tenant)
    assert served(r, plan, 3) == ["zzz-a", "mmm-y", "aaa-w"]
    push(r, s, "normal", est=EST, tenant="zzz-a")
    assert served(r, plan, 3) == ["zzz-a", "mmm-y", "aaa-w"]


def test_lua_and_python_agree_on_a_score_with_its_tie(r, settings):
    s, _ = plan_of(settings)
    push(r, s, "normal", est=EST, tenant="one")
    push(r, s, "normal", est=EST, tenant="two")
    keys = Keys(s.key_prefix)
    n = int(r.hget(keys.fair("default"), "n:normal"))
    assert float(r.zscore(keys.active("default", "normal"), "two")) == active_score(0, False, 0, tie(n))
    assert float(r.zscore(keys.active("default", "normal"), "one")) == active_score(0, False, 0, tie(n - 1))


@pytest.mark.parametrize("start,scheduled,lag,n,expected", [
    (0, False, 8192, 0, 0),                                # the counter's first step: no fraction
    (0, False, 8192, 1, 2 ** -TIE_BITS),
    (100, False, 8192, 3, 200 + 3 * 2 ** -TIE_BITS),
    (100, True, 8192, 3, 16585 + 3 * 2 ** -TIE_BITS),      # scheduled: the lag and parity kept
    (0, False, 0, 2 ** TIE_BITS + 5, 5 * 2 ** -TIE_BITS),  # the counter wraps
    (2 ** 40, False, 0, 3, 2 ** 41),                       # 10 bits beside 2^41: 3 x 2^-20 rounds down to 0
    (2 ** 30, False, 0, 2 ** 19, 2 ** 31 + 0.5),           # 2^31 + 0.5: 2^31 <= 2^32 keeps all 20 bits
])
def test_active_score_with_its_tie(start, scheduled, lag, n, expected):
    score = active_score(start, scheduled, lag, tie(n))
    assert score == expected
    assert start_tag(score, lag) == start


@pytest.mark.parametrize("whole", [0, 1, 2 ** 20, 2 ** 31, 2 ** 32, 2 ** 40, 2 ** 51, 2 ** 52])
def test_a_tie_never_changes_the_whole_part_or_the_order_of_tags(whole):
    for n in (1, 2 ** 19, 2 ** TIE_BITS - 1):
        score = active_score(whole, False, 0, tie(n))
        assert score // 1 == 2 * whole
        assert score < active_score(whole + 1, False, 0, tie(0))
