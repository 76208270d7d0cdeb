"""Each script's KEYS and ARGV are defined once, in its header (``scripts.layout``): the Lua
side reads them by the names generated from it, the Python side builds them by name.  These
tests fail on drift: a name the Lua uses that the header does not declare (or a declared one
it never reads), a literal position left in a script, a call class whose KEYS or ARGV do not
fit its script's layout (a count that disagrees with its records, a value too many or few),
a script without a call class or a call class without a sample here."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

from gateway_tasks.lifecycle.cancel import CancelCall, TaskRef
from gateway_tasks.dispatch.deadline import DeadlineCall
from gateway_tasks.lifecycle.depends import DependCall, DepsDoneCall, DepsJoinCall, DepsReleaseCall
from gateway_tasks.lifecycle.inherit import BoostCall
from gateway_tasks.dispatch.enqueue import EnqueueCall
from gateway_tasks.dispatch.evict import EvictCall
from gateway_tasks.core.keys import Keys
from gateway_tasks.tenants.quota import QuotaRefundCall, QuotaTakeCall
from gateway_tasks.core.result_backend import ResultStoreCall
from gateway_tasks.core.scripts import (GROUP, Layout, LayoutError, available, body, includes, layout, scripts_for,
                                        source)
from gateway_tasks.core.settings import MAX_LEVEL, Pool
from beat.cron_calls import CronAdmittedCall, CronFireCall, CronRecordCall, CronResyncCall
from beat.lock import LockReleaseCall, LockRenewCall
from gateway_tasks.bucket.calls import DrainCall, SettleCall, SyncLimitsCall, TakeCall
from gateway_tasks.upstream.circuit import CircuitCall
from gateway_tasks.overload.controller import OverloadCommitCall
from gateway_tasks.overload.deferral import DeferHoldCall, DeferReleaseCall
from gateway_tasks.dispatch.release import ReleaseCall, RenewCall
from gateway_tasks.upstream.rescue import WithdrawCall
from gateway_tasks.dispatch.router import PickPlan
from gateway_tasks.usage.counters import UsageCall

CALL_MODULES = ("gateway_tasks.lifecycle.cancel", "gateway_tasks.dispatch.deadline", "gateway_tasks.lifecycle.depends",
                "gateway_tasks.lifecycle.inherit",
                "gateway_tasks.dispatch.enqueue", "gateway_tasks.dispatch.evict",
                "gateway_tasks.tenants.quota", "gateway_tasks.core.result_backend", "beat.cron_calls", "beat.lock",
                "gateway_tasks.bucket.calls", "gateway_tasks.upstream.circuit", "gateway_tasks.upstream.failover",
                "gateway_tasks.overload.controller", "gateway_tasks.dispatch.release", "gateway_tasks.upstream.rescue",
                "gateway_tasks.dispatch.router", "gateway_tasks.overload.deferral", "gateway_tasks.usage.counters")
NAME = re.compile(r"\b([KAN]_\w+)")
LITERAL_POSITION = re.compile(r"\b(?:KEYS|ARGV)\[\s*\d")


def code(name: str) -> str:
    """A script's Lua with its parts, comments taken out."""
    return re.sub(r"--[^\n]*", "", body(name))


@pytest.mark.parametrize("name", available())
def test_the_lua_reads_what_its_header_declares_and_nothing_else(name):
    lay = layout(name)
    used = set(NAME.findall(code(name)))
    assert used <= set(lay.lua_names()), sorted(used - set(lay.lua_names()))
    assert set(lay.field_names()) <= used, sorted(set(lay.field_names()) - used)
    for group in lay.groups():
        assert f"N_{group}" in used, group


@pytest.mark.parametrize("name", available())
def test_no_script_reads_keys_or_argv_at_a_literal_position(name):
    assert not LITERAL_POSITION.findall(code(name))


@pytest.mark.parametrize("name", available())
def test_every_script_loads(r, name):
    assert scripts_for(r).client.script_load(source(name)) == scripts_for(r).sha(name)


def test_pick_is_spliced_from_its_parts():
    parts = includes("dispatch/pick")
    assert {"dispatch/pick/candidates", "dispatch/pick/scoring", "dispatch/pick/admission",
            "dispatch/pick/dispatch"} <= set(parts)
    assert all(p.rpartition("/")[0] == "dispatch/pick" and p not in available() for p in parts)


def samples(settings) -> list:
    k = Keys(settings.key_prefix)
    pool = settings.pools[0]
    tiers = [t.name for t in settings.tiers]
    tier = settings.tiers[0]
    take = QuotaTakeCall(k, "acme", 1_700_000_000_000, 10, 100, 6000)
    plan = PickPlan(settings, settings.queue_names())
    return [
        DeadlineCall(k, pool.name, tier.name, 1_700_000_000_000, "e"),
        EvictCall(k, pool.name, tuple(tiers), (0, 5)),
        EnqueueCall(k, tier, pool.name, "acme", "tag", 10, "{}"),
        EnqueueCall(k, tier, pool.name, "acme", "tag", 10, "{}", pool_capacity=100, pool_tiers=tuple(tiers),
                    task_id="t1", ref_ttl_s=60),
        take, QuotaRefundCall(take, True),
        DependCall(k, "t1", ("d1", "d2"), "{}", 1000),
        DepsDoneCall(k, "t1", "ok", 1000), DepsDoneCall(k, "t1", "ok", 1000, check_cancelled=True),
        DepsJoinCall(k, "d1", "t1", 1000), DepsReleaseCall(k, "t1", "d1", "ok"),
        BoostCall(k, pool.name, tier.name, tiers[-1], "e"),
        ResultStoreCall("result", "{}", 0),
        CancelCall(k, "t1", TaskRef(pool.name, tier.name, "acme", "tag"), "e"),
        WithdrawCall(k, pool.name, tier.name, 10),
        ReleaseCall(k, settings, pool.name, "tag"), ReleaseCall(k, settings, pool.name, "tag", wake="bell"),
        RenewCall(k, pool.name, (("a", "1"), ("b", "2")), 1000, 5000),
        plan, plan.batch(4, 2),
        OverloadCommitCall(k, 0, 100, 1, 0, "ok", {}, {}, 5, (None,) * MAX_LEVEL),
        DeferHoldCall(k, "t1", tier.name, "{}", 1000, "capacity_pressure", 3, 5000),
        DeferReleaseCall(k, "t1"),
        CircuitCall(k, pool.name, "allow", settings.circuit),
        TakeCall(k, pool, 10),
        SettleCall(k, pool, tier.name, "acme", "m", 10, 12, 2, 0.5, False),
        SyncLimitsCall(k, pool, 100.0, None),
        DrainCall(k, pool, 1000),
        LockRenewCall("lock", "token", 1000), LockReleaseCall("lock", "token"),
        CronFireCall(k, "c1", "acme", 1, 2, 3, 4, "fire", 10, 5, 1000, tier.name, 0),
        CronAdmittedCall(k, "c1", "fired", 2, 5),
        CronResyncCall(k, "c1", 1, 2),
        CronRecordCall(k, "c1", last_error="", last_task_id="t1"),
        UsageCall(k, "acme", 1_700_000_000_000, 31, {"requests": 1, "actual_tokens": 12}),
    ]


def test_every_call_fits_its_scripts_layout(settings):
    settings = settings.with_(pools=(*settings.pools, Pool("spare", base_url="http://127.0.0.1:1/v1",
                                                             api_key="x", models=("m",), tpm=6000, rpm=60)))
    for call in samples(settings):
        lay = layout(call.SCRIPT)
        keys, args = list(call.script_keys), list(call.script_args)
        named = lay.read(keys, args)
        for item in (*lay.keys_items, *lay.args_items):
            if item.kind == GROUP:
                assert len(named[item.name]) == int(named[item.count]), (call.SCRIPT, item.name)


def test_every_script_has_a_call_and_every_call_a_sample(settings):
    classes = {cls for module in CALL_MODULES for _, cls in inspect.getmembers(importlib.import_module(module),
                                                                               inspect.isclass)
               if isinstance(getattr(cls, "SCRIPT", None), str) and cls.__module__ == module}
    assert {cls.SCRIPT for cls in classes} == set(available())
    assert {type(call) for call in samples(settings)} >= classes


def test_a_call_that_does_not_fit_fails_by_name():
    lay = layout("bucket/drain")
    with pytest.raises(LayoutError, match="retry_after_ms"):
        lay.args(stats_field="x")
    with pytest.raises(LayoutError, match="no ARGV"):
        lay.args(retry_after_ms=1, stats_field="x", extra=1)
    with pytest.raises(LayoutError, match="past its layout"):
        lay.read(["bucket", "stats", "more"], [1, "x"])
    with pytest.raises(LayoutError, match="records per"):
        layout("dispatch/evict").args(T=3, tier=[dict(name="a", lag_tokens=0)])


def test_positions_are_numbers_computed_once_in_front_of_the_script():
    text = layout("dispatch/pick").lua()
    assert "local A_max_picks = 6" in text
    assert "local K_queue_index = K_pool_state + K_per_pool * N_pool" in text
    assert text.count("ARGV[") == len(layout("dispatch/pick").groups())   # the counts, read once each
    assert isinstance(layout("dispatch/pick"), Layout)
