"""Every Lua script and every MULTI transaction of the project, run on a real Redis Cluster
(conftest's redis_cluster fixture, 3 masters) with the keys the project's own call builders and functions
produce: none crosses a hash slot -- redis-py refuses such a call before sending it, the
server answers CROSSSLOT -- and no fixed hash tag gathers every tenant's or every task's
keys (one hot shard).  A script or a transaction added without a case here fails the
coverage tests below."""

from __future__ import annotations

import ast
import inspect
import json
import pathlib

import pytest

from beat.cron_calls import CronAdmittedCall, CronFireCall, CronRecordCall, CronResyncCall
from beat.lock import LockReleaseCall, LockRenewCall
from beat.store import CronStore
from devtools.redis_cluster import slot_of
from devtools.run_redis import delete_prefix
from gateway_tasks.bucket.calls import DrainCall, SettleCall, SyncLimitsCall, TakeCall
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.result_backend import ResultStoreCall
from gateway_tasks.core.scripts import available, scripts_for
from gateway_tasks.core.settings import DEFER, MAX_LEVEL, load_settings
from gateway_tasks.dispatch.broker import purge_tier
from gateway_tasks.dispatch.dead_letters import DeadLetterer
from gateway_tasks.dispatch.deadline import DeadlineCall
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.dispatch.evict import EvictCall
from gateway_tasks.dispatch.release import ReleaseCall, RenewCall
from gateway_tasks.dispatch.router import PickPlan, Picked
from gateway_tasks.lifecycle import depends, inherit
from gateway_tasks.lifecycle.cancel import CancelCall, TaskRef
from gateway_tasks.lifecycle.inherit import BoostCall
from gateway_tasks.overload import deferral
from gateway_tasks.overload.actions import Action
from gateway_tasks.overload.controller import OverloadCommitCall
from gateway_tasks.producer.cancel import _drop_held
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.tenants.quota import QuotaRefundCall, QuotaTakeCall
from gateway_tasks.tenants.registry import LEGACY_HASH_FIELD, TenantRegistry, hash_api_key
from gateway_tasks.upstream.circuit import CircuitCall
from gateway_tasks.upstream.reservation import Reservation
from gateway_tasks.upstream.rescue import WithdrawCall
from gateway_tasks.usage.counters import UsageCall
from workers.pipeline import Job, _count_failure

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNTIME = ("gateway_tasks", "beat", "workers")   # where the runtime's transactions live
NOW_MS = 1_700_000_000_000
POOL = "default"


@pytest.fixture
def cl(redis_cluster, key_prefix, redis_url):
    """A RedisCluster client on the fixture's cluster, and settings under the test's prefix
    (its keys go at teardown)."""
    client = redis_cluster.client()
    settings = load_settings(env={}, redis_url=redis_url, key_prefix=key_prefix)
    yield client, settings
    delete_prefix(client, key_prefix)
    client.close()


def message(tenant: str, tag: str, task_id: str, est: int = 10) -> str:
    return json.dumps({"body": "", "headers": {"gt_est_tokens": est, "gt_tenant": tenant, "id": task_id},
                       "properties": {"delivery_tag": tag}})


def script_calls(client, settings) -> tuple[list, list]:
    """(calls run with Scripts.run, enqueues run through enqueue's MULTI) -- at least one of
    every script, its keys as the runtime names them; the dispatch ones on a task really
    enqueued and picked."""
    k, tiers = Keys(settings.key_prefix), [t.name for t in settings.tiers]
    tier, pool = settings.tiers[0], settings.pools[0]
    enqueue_call = EnqueueCall(k, tier, POOL, "acme", "tag-1", 10, message("acme", "tag-1", "task-1"),
                               task_id="task-1", ref_ttl_s=60, pool_capacity=100, pool_tiers=tuple(tiers))
    assert enqueue(client, enqueue_call).accepted
    plan = PickPlan(settings, settings.queue_names())
    picked = scripts_for(client).run(plan)
    assert isinstance(picked, Picked)
    entry = "acme|1|tag-2|10|1|1"
    take = QuotaTakeCall(k, "acme", NOW_MS, 10, 100, 6000)
    fire = CronFireCall(k, "acme:nightly", "acme", 1, 2, 3, 4, "fire", 10, NOW_MS, 1000, tier.name, 0)
    calls = [
        DeadlineCall(k, POOL, tier.name, NOW_MS, entry),
        EvictCall(k, POOL, tuple(tiers), (0,) * len(tiers)),
        take, QuotaRefundCall(take, True), fire.quota(),
        depends.DependCall(k, "child", ("parent-a", "parent-b"), "{}", 60_000, tier.name),
        depends.DepsJoinCall(k, "parent-a", "child", 60_000),
        depends.DepsReleaseCall(k, "child", "parent-a", "ok"),
        depends.DepsDoneCall(k, "parent-b", "ok", 60_000), depends.done_call(k, "parent-b"),
        BoostCall(k, POOL, tier.name, tiers[0], entry),
        ResultStoreCall(k.result("task-1"), "{}", 60),
        CancelCall(k, "task-9", TaskRef(POOL, tier.name, "acme", "tag-9"), entry),
        WithdrawCall(k, POOL, tier.name, 10),
        RenewCall(k, POOL, ((picked.tag, str(picked.dispatched_ms)),), 1000, 5000),
        ReleaseCall(k, settings, POOL, picked.tag, token=str(picked.dispatched_ms),
                    wake=k.dispatcher_bell(POOL, "dispatcher-1")),
        plan.batch(4, 2),
        OverloadCommitCall(k, 0, 100, 1, 0, "ok", {}, {}, 5, (None,) * MAX_LEVEL),
        deferral.DeferHoldCall(k, "deferred-1", tier.name, "{}", NOW_MS, "capacity_pressure", 3, 5000),
        deferral.DeferReleaseCall(k, "deferred-1"),
        CircuitCall(k, POOL, "allow", settings.circuit),
        TakeCall(k, pool, 10), SettleCall(k, pool, tier.name, "acme", "m", 10, 12, 2, 0.5, False),
        SyncLimitsCall(k, pool, 100.0, None), DrainCall(k, pool, 1000),
        LockRenewCall(k.beat_lock, "token", 1000), LockReleaseCall(k.beat_lock, "token"),
        fire, CronAdmittedCall(k, "acme:nightly", "fired", 2, NOW_MS), CronResyncCall(k, "acme:nightly", 1, 2),
        CronRecordCall(k, "acme:nightly", last_error="", last_task_id="task-1"),
        UsageCall(k, "acme", NOW_MS, 31, {"requests": 1, "actual_tokens": 12}),
    ]
    return calls, [enqueue_call]


def test_every_script_runs_on_a_cluster_in_one_slot(cl):
    client, settings = cl
    calls, enqueues = script_calls(client, settings)
    assert {c.SCRIPT for c in calls + enqueues} == set(available())   # a new script needs a case here
    scripts = scripts_for(client)
    for call in calls:
        keys = list(call.script_keys)
        assert len({slot_of(key) for key in keys}) == 1, (call.SCRIPT, keys)
        scripts.run(call)         # keys of two slots: refused (redis-py), or CROSSSLOT (the server)
    for call in enqueues:
        assert len({slot_of(key) for key in call.script_keys}) == 1


def test_the_steps_across_slots_run_on_a_cluster(cl):
    """What spans tasks or slots runs as the project runs it -- single-slot scripts in
    sequence, pipelines of one-key commands: a dependent held on two dependencies (one
    finished already) then released, a lender's chain, a deferral held then released."""
    client, settings = cl
    k, tier = Keys(settings.key_prefix), settings.tiers[-1].name
    scripts = scripts_for(client)
    scripts.run(depends.DepsDoneCall(k, "finished", "ok", 60_000))
    assert depends.hold(client, k, "held", ("finished", "running"), '{"task_id": "held"}', 60_000, tier) == (
        "running",)
    assert depends.unguard(client, k, "held") is None                       # waits on "running"
    done = scripts.run(depends.DepsDoneCall(k, "running", "ok", 60_000))
    assert done.waiting == ("held",)
    assert scripts.run(depends.DepsReleaseCall(k, "held", "running", "ok")) == depends.Released(
        {"task_id": "held"}, "")
    inherit.lend_to(client, k, "origin", settings.tiers[0].name, "lent-to", 60)
    inherit.take_back(client, k, settings, [POOL], "origin", ["lent-to"])
    assert client.hlen(k.lift("lent-to")) == 0 and client.scard(k.lifted("origin")) == 0
    action = Action(DEFER, 3, tier, 0, retry_after_s=1.0, reason="capacity_pressure")
    spec = json.dumps({"task_id": "deferred-1", "queue": settings.queue_name(tier, POOL),
                       "body": {"pool": POOL, "est_tokens": 10}})
    deferral.hold(client, k, "deferred-1", tier, POOL, spec, action, NOW_MS, NOW_MS, 60)
    assert deferral.held_counts(client, k, settings.tiers, [POOL])[tier] == 1
    specs, _ = scripts.run_together([deferral.DeferReleaseCall(k, "deferred-1")])
    assert specs == [json.loads(spec)]


# -- every MULTI transaction: each case runs the function that holds one, on the cluster ------
def run_registry(client, settings) -> None:
    registry = TenantRegistry(client, settings)
    registry.register("acme", "vip", api_key="first-key-123")
    registry.register("acme", "vip", api_key="second-key-456")       # its key replaced
    registry.r.hset(registry.keys.tenant("acme"), mapping={"api_key_hash": "", LEGACY_HASH_FIELD:
                                                           hash_api_key("second-key-456").partition(":")[2]})
    assert registry.authenticate("second-key-456").tenant_id == "acme"   # a legacy digest: rehashed
    assert [t.tenant_id for t in registry.list()] == ["acme"]
    registry.delete("acme")
    assert registry.list() == []


def run_crons(client, settings) -> None:
    registry = TenantRegistry(client, settings)
    registry.register("acme", "vip")
    gateway = Gateway(settings, client=client)
    try:
        store = CronStore(client, settings, gateway=gateway)
        store.add("acme", "nightly", "0 3 * * *", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 5})
        assert store.run_secret("acme:nightly")
        assert store.delete("acme", "nightly")
        _drop_held_case(gateway)
    finally:
        gateway.app.close()


def _drop_held_case(gateway: Gateway) -> None:
    k, tier = gateway.keys, gateway.settings.tiers[-1].name
    spec = json.dumps({"task_id": "deferred-2", "queue": gateway.settings.queue_name(tier, POOL),
                       "body": {"pool": POOL, "tenant_id": "acme", "est_tokens": 10, "tenant_tpm": 0}})
    deferral.hold(gateway.r, k, "deferred-2", tier, POOL, spec,
                  Action(DEFER, 3, tier, 0, retry_after_s=1.0, reason="capacity_pressure"), NOW_MS, NOW_MS, 60)
    assert _drop_held(gateway, "deferred-2") == "deferred"
    assert deferral.held_counts(gateway.r, k, gateway.settings.tiers, [POOL])[tier] == 0


def run_dead_letter(client, settings) -> None:
    k, tier = Keys(settings.key_prefix), settings.tiers[0]
    enqueue(client, EnqueueCall(k, tier, POOL, "acme", "bad-1", 10, message("acme", "bad-1", "task-bad")))
    picked = scripts_for(client).run(PickPlan(settings, settings.queue_names()))
    DeadLetterer(client, scripts_for(client), k, settings)(picked, "a test's dead letter")
    assert client.llen(k.dead_letters(POOL)) == 1


def run_count_failure(client, settings) -> None:
    k = Keys(settings.key_prefix)
    job = Job("task-1", None, settings, k, client, None, Reservation(client, k, "", ""))
    assert _count_failure(job) == 1 and _count_failure(job) == 2


def run_enqueue(client, settings) -> None:
    k = Keys(settings.key_prefix)
    assert enqueue(client, EnqueueCall(k, settings.tiers[0], POOL, "acme", "tag-5", 10,
                                       message("acme", "tag-5", "task-5"))).accepted


def run_purge(client, settings) -> None:
    k, tier = Keys(settings.key_prefix), settings.tiers[0]
    enqueue(client, EnqueueCall(k, tier, POOL, "acme", "tag-6", 10, message("acme", "tag-6", "task-6")))
    assert purge_tier(client, k, POOL, tier.name) == 1


# 'module:function' holding a transaction (pipeline(transaction=True) or WATCH/MULTI) -> its case
TRANSACTIONS = {
    "gateway_tasks.tenants.registry:TenantRegistry.register": run_registry,
    "gateway_tasks.tenants.registry:TenantRegistry._rehash": run_registry,
    "beat.store:CronStore.add": run_crons,
    "beat.store:CronStore.delete": run_crons,
    "beat.store:CronStore.run_secret": run_crons,
    "gateway_tasks.producer.cancel:_drop_held": run_crons,
    "gateway_tasks.dispatch.dead_letters:DeadLetterer.__call__": run_dead_letter,
    "workers.pipeline:_count_failure": run_count_failure,
    "gateway_tasks.dispatch.enqueue:_enqueue_on": run_enqueue,
    "gateway_tasks.dispatch.broker:purge_tier": run_purge,
}


def transaction_sites() -> set[str]:
    """Every 'module:function' of the runtime that opens a pipeline without transaction=False
    (redis-py's pipeline() is a MULTI on one server; on a cluster it is one only when asked)."""
    found: set[str] = set()
    for root in RUNTIME:
        for path in sorted((ROOT / root).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for scope in _scopes(tree):
                for node in ast.walk(scope[-1]):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr == "pipeline" and not _no_transaction(node)
                            and _innermost(scope, node)):
                        found.add(f"{module}:{'.'.join(s.name for s in scope)}")
    return found


def _scopes(tree: ast.AST, outer: tuple = ()) -> list[tuple]:
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            here = (*outer, node)
            if not isinstance(node, ast.ClassDef):
                out.append(here)
            out += _scopes(node, here)
    return out


def _innermost(scope: tuple, call: ast.Call) -> bool:
    """The call is in the scope's own body, not in a function nested in it."""
    inner = [n for n in ast.walk(scope[-1]) if n is not scope[-1]
             and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    return not any(call in ast.walk(n) for n in inner)


def _no_transaction(call: ast.Call) -> bool:
    return any(kw.arg == "transaction" and isinstance(kw.value, ast.Constant) and kw.value.value is False
               for kw in call.keywords)


def test_every_transaction_of_the_runtime_has_a_case_here():
    assert transaction_sites() == set(TRANSACTIONS)


@pytest.mark.parametrize("case", sorted({f.__name__ for f in TRANSACTIONS.values()}))
def test_every_transaction_runs_on_a_cluster(cl, case):
    client, settings = cl
    {f.__name__: f for f in TRANSACTIONS.values()}[case](client, settings)


# -- no fixed tag gathers every tenant's or task's keys --------------------------------------
SCHEDULE = {"cron_tenant"}   # the beat's schedule, one slot by design (Keys: one leader works it)


def scoped_key_names(param: str) -> list[str]:
    """Keys methods whose first argument is ``param`` (tenant_id or task_id)."""
    return [name for name, fn in inspect.getmembers(Keys, inspect.isfunction)
            if list(inspect.signature(fn).parameters)[1:2] == [param]]


@pytest.mark.parametrize("param", ["tenant_id", "task_id"])
def test_no_fixed_hash_tag_gathers_every_tenant_or_every_task(param):
    keys = Keys("gt:")
    names = [n for n in scoped_key_names(param) if n not in SCHEDULE]
    assert len(names) >= 6
    ids = [f"id-{i}" for i in range(64)]
    for name in names:
        fn = getattr(keys, name)
        extra = [1] * (len(inspect.signature(fn).parameters) - 1)
        slots = {slot_of(fn(i, *extra)) for i in ids}
        assert len(slots) >= 48, f"Keys.{name}: 64 ids in {len(slots)} slots"


def test_one_tenants_and_one_tasks_keys_share_its_slot():
    keys = Keys("gt:")
    for param, tag in (("tenant_id", keys.tenant_tag), ("task_id", keys.task_tag)):
        for name in scoped_key_names(param):
            fn = getattr(keys, name)
            extra = [1] * (len(inspect.signature(fn).parameters) - 1)
            key = fn("acme", *extra)
            if name in SCHEDULE or "{" not in key:   # untagged: a key used alone
                continue
            assert slot_of(key) == slot_of(tag("acme")), name
