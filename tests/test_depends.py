"""depends_on: a task is held -- no queue space, no tokens -- until the tasks it names
have finished, then queued; a dependency that did not succeed fails it with
DependencyFailed.  Real Redis; the last test runs a real worker."""

from __future__ import annotations

import pytest
from celery import states
from fastapi.testclient import TestClient

from gateway_tasks.lifecycle import depends
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.core.errors import DependencyFailed, InvalidRequest, UnknownTask
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app
from gateway_tasks.tenants.quota import hour_of
from gateway_tasks.core.clock import redis_now_ms


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("bulk", "batch"), ("acme", "vip")])


def queued_ids(gw: Gateway, tier: str) -> list[str]:
    return [m["headers"]["id"] for m in queued_messages(gw.r, Keys(gw.settings.key_prefix), "default", tier)]


def finish(gw: Gateway, task_id: str, ok: bool) -> int:
    return depends.finish(gw.app, gw.r, gw.keys, gw.settings.result_ttl_s, task_id, ok)


def test_held_until_every_dependency_finished(gw):
    a = gw.submit("bulk", "first", max_tokens=5)
    b = gw.submit("bulk", "second", max_tokens=5)
    child = gw.submit("bulk", "after both", max_tokens=5, depends_on=[a.id, b.id, a.id])
    assert queued_ids(gw, "batch") == [a.id, b.id] and child.status == states.PENDING
    assert finish(gw, a.id, ok=True) == 0          # one still running
    assert child.id not in queued_ids(gw, "batch")
    assert finish(gw, b.id, ok=True) == 1
    assert child.id in queued_ids(gw, "batch")
    assert finish(gw, b.id, ok=True) == 0          # once only


def test_a_failed_dependency_fails_the_dependents(gw):
    a = gw.submit("acme", "doomed", max_tokens=5)
    child = gw.submit("acme", "after it", max_tokens=5, depends_on=[a.id])
    grandchild = gw.submit("acme", "after the child", max_tokens=5, depends_on=[child.id])
    finish(gw, a.id, ok=False)
    for h in (child, grandchild):
        with pytest.raises(DependencyFailed, match="did not succeed") as info:
            h.get(timeout=5)
        assert info.value.reason == "dependency_failed"
    assert queued_ids(gw, "vip") == [a.id]


def test_cancelling_a_dependency_fails_its_dependent_and_a_held_task_can_be_cancelled(gw):
    a = gw.submit("acme", "cancelled soon", max_tokens=5)
    child = gw.submit("acme", "after it", max_tokens=5, depends_on=[a.id])
    gw.cancel(a.id)
    with pytest.raises(DependencyFailed):
        child.get(timeout=5)
    b = gw.submit("acme", "stays", max_tokens=5)
    held = gw.submit("acme", "cancelled while held", max_tokens=5, depends_on=[b.id])
    assert gw.cancel(held.id).was == "waiting"
    finish(gw, b.id, ok=True)
    assert queued_ids(gw, "vip") == [b.id]            # dropped, not released


def test_a_hold_spans_slots_guarded_and_counts_each_dependency_once(gw):
    """Holding spans slots -- the task's record, each dependency's waiters -- so it is steps:
    the record counts one more than its dependencies (the guard) until every one is
    registered; a dependency that ended before it is registered is counted by the submit, one
    that ends after by its own end, each once whatever is run again; a submit cut short before
    its guard goes leaves a record nothing releases."""
    a = gw.submit("bulk", "ends before it is registered", max_tokens=5)
    b = gw.submit("bulk", "ends while the hold is guarded", max_tokens=5)
    scripts, k = depends.scripts_for(gw.r), gw.keys
    assert scripts.run(depends.DependCall(k, "held-1", (a.id, b.id), '{"task_id": "held-1"}', 60_000, "batch")) == 3
    assert finish(gw, a.id, ok=True) == 0                      # nobody registered on it yet
    assert scripts.run(depends.DepsJoinCall(k, a.id, "held-1", 60_000)) == "ok"   # ended: the submit counts it
    assert scripts.run(depends.DepsReleaseCall(k, "held-1", a.id, "ok")) is None
    assert scripts.run(depends.DepsJoinCall(k, b.id, "held-1", 60_000)) == ""     # waits on b
    assert finish(gw, b.id, ok=False) == 0                     # counted, the guard holds it
    assert scripts.run(depends.DepsReleaseCall(k, "held-1", b.id, "failed")) is None   # once only
    assert gw.r.hmget(k.held("held-1"), "pending", "deps") == [b"1", b""]
    assert depends.unguard(gw.r, k, "held-1") == depends.Released({"task_id": "held-1"}, b.id)
    assert depends.unguard(gw.r, k, "held-1") is None and not gw.r.exists(k.held("held-1"))
    c = gw.submit("bulk", "its dependent's submit is cut short", max_tokens=5)
    scripts.run(depends.DependCall(k, "held-2", (c.id,), "{}", 60_000, "batch"))
    assert scripts.run(depends.DepsJoinCall(k, c.id, "held-2", 60_000)) == ""
    assert finish(gw, c.id, ok=True) == 0 and gw.r.hget(k.held("held-2"), "pending") == b"1"


def test_dependents_submitted_while_their_dependency_ends_are_each_queued_once(gw):
    """Submits holding on a task race its end (threads): whichever way each hold and the end
    interleave -- joined before the done mark, or seeing it -- every dependent is queued
    exactly once, and nothing stays held."""
    import threading
    import time

    dep = gw.submit("acme", "ends while its dependents are submitted", max_tokens=5)
    ids: list[str] = []
    ended: list[int] = []
    go = threading.Barrier(9)

    def submit() -> None:
        go.wait()
        for _ in range(4):
            ids.append(gw.submit("acme", "after it", max_tokens=5, depends_on=[dep.id]).id)

    def end() -> None:
        go.wait()
        while len(ids) < 12:      # some held already, the others on their way
            time.sleep(0.001)
        ended.append(finish(gw, dep.id, ok=True))

    threads = [threading.Thread(target=submit) for _ in range(8)] + [threading.Thread(target=end)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queued = queued_ids(gw, "vip")
    assert len(ids) == 32 and sorted(queued) == sorted([dep.id, *ids])       # each once
    assert ended[0] >= 12                 # those held before its end: released by it, the others by their submit
    assert not any(gw.r.exists(gw.keys.held(i)) for i in ids) and not gw.r.exists(gw.keys.waiters(dep.id))


def test_marked_done_in_the_settle_round_trip_then_finished(gw):
    """The worker marks a task done in its settle round trip (``done_call``: the waiters stay);
    its end then needs nothing more when nobody waits, hands the waiters over when some do, and
    marks it again when it failed after all."""
    scripts = depends.scripts_for(gw.r)
    alone = gw.submit("acme", "nobody waits", max_tokens=5)
    done = scripts.run(depends.done_call(gw.keys, alone.id))
    assert done == depends.Done("ok", ()) and gw.r.get(gw.keys.done(alone.id)) == b"ok"
    assert depends.finish(gw.app, gw.r, gw.keys, 60, alone.id, True, done) == 0
    waited = gw.submit("bulk", "one waits", max_tokens=5)
    child = gw.submit("bulk", "after it", max_tokens=5, depends_on=[waited.id])
    done = scripts.run(depends.done_call(gw.keys, waited.id))
    assert done == depends.Done("ok", (child.id,)) and queued_ids(gw, "batch") == [waited.id]
    late = gw.submit("bulk", "submitted after the mark", max_tokens=5, depends_on=[waited.id])
    assert depends.finish(gw.app, gw.r, gw.keys, 60, waited.id, True, done) == 1
    assert sorted(queued_ids(gw, "batch")) == sorted([waited.id, child.id, late.id])   # the late one: not held
    failing = gw.submit("acme", "fails after its settle", max_tokens=5)
    doomed = gw.submit("acme", "after the failure", max_tokens=5, depends_on=[failing.id])
    done = scripts.run(depends.done_call(gw.keys, failing.id))
    assert depends.finish(gw.app, gw.r, gw.keys, 60, failing.id, False, done) == 1
    assert gw.r.get(gw.keys.done(failing.id)) == b"failed"
    with pytest.raises(DependencyFailed):
        doomed.get(timeout=5)


def test_finished_and_unknown_dependencies(gw):
    a = gw.submit("acme", "done already", max_tokens=5)
    finish(gw, a.id, ok=True)
    now = gw.submit("acme", "runs at once", max_tokens=5, depends_on=[a.id])
    assert queued_ids(gw, "vip") == [a.id, now.id]
    bad = gw.submit("acme", "failed already", max_tokens=5)
    finish(gw, bad.id, ok=False)
    before = int(gw.r.get(gw.keys.quota("acme", hour_of(redis_now_ms(gw.r)))))
    with pytest.raises(DependencyFailed):
        gw.submit("acme", "refused", max_tokens=5, depends_on=[bad.id])
    assert int(gw.r.get(gw.keys.quota("acme", hour_of(redis_now_ms(gw.r))))) == before   # given back
    with pytest.raises(UnknownTask, match="unknown tasks"):
        gw.submit("acme", "x", max_tokens=5, depends_on=["no-such-task"])
    with pytest.raises(InvalidRequest, match="list of task ids"):
        gw.submit("acme", "x", max_tokens=5, depends_on="abc")


def test_rest_depends_on(gw):
    key = gw.register_tenant("acme", "vip")
    with TestClient(create_app(gw)) as client:
        post = lambda body: client.post("/v1/tasks", json={"messages": [{"role": "user", "content": "x"}], **body},  # noqa: E731
                                        headers={"Authorization": f"Bearer {key}"})
        first = post({}).json()["task_id"]
        res = post({"depends_on": [first]})
        assert res.status_code == 202
        assert queued_ids(gw, "vip") == [first]
        res = post({"depends_on": ["nope"]})
        assert res.status_code == 404 and res.json()["error"]["type"] == "UnknownTask"


@pytest.mark.slow
def test_a_dependent_runs_after_its_dependency(settings, r, tmp_path):
    with SimulatorThread(SimConfig(base_latency_ms=300)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=600_000, rpm=6_000)
        s = settings.with_(pools=(pool,))
        g = Gateway(s, client=r)
        g.register_tenant("bulk", "batch")
        g.register_tenant("acme", "vip")
        worker = processes.worker(s, concurrency=4, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(g.app, 1)
            dep = g.submit("bulk", "first", max_tokens=5)
            child = g.submit("bulk", "second", max_tokens=5, depends_on=[dep.id])
            first, second = dep.get(timeout=30), child.get(timeout=30)
        finally:
            worker.stop()
            g.app.close()
    assert second["timing"]["enqueued_ms"] >= first["timing"]["dispatched_ms"] + 300


def test_a_dependency_finished_long_ago_is_read_from_its_result(gw):
    """The done mark lives only minutes; after it, the stored result says how it ended."""
    ok = gw.submit("bulk", "succeeded long ago", max_tokens=5)
    bad = gw.submit("bulk", "failed long ago", max_tokens=5)
    gw.app.backend.store_result(ok.id, {"response": {}}, states.SUCCESS)
    gw.app.backend.store_result(bad.id, DependencyFailed("x", None, "dependency_failed"), states.FAILURE)
    assert gw.r.ttl(gw.keys.done(ok.id)) == -2 and depends.DONE_MARK_TTL_S <= 600
    now = gw.submit("bulk", "runs at once", max_tokens=5, depends_on=[ok.id])
    assert now.id in queued_ids(gw, "batch")
    with pytest.raises(DependencyFailed, match=bad.id):
        gw.submit("bulk", "refused", max_tokens=5, depends_on=[ok.id, bad.id])
