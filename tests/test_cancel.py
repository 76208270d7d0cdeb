"""Cancel: Gateway.cancel, DELETE /v1/tasks/{id} (owner only), `gateway task cancel`, and
the synchronous endpoint cancelling its task when the client times out or leaves.  A
queued task is removed with its message in one atomic step and never reaches the
upstream; a running one is revoked, its result discarded, and a SIGKILL of its worker
does not bring it back (the lease sweep drops it).  Real Redis, real workers."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from dataclasses import replace

import httpx
import pytest
import uvicorn
from celery import states
from fastapi.testclient import TestClient

from gateway_tasks.cli import task as task_cli
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.lifecycle.cancel import TaskRef, read_refs
from gateway_tasks.core.errors import QueueFull, TaskCancelled, UnknownTask
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool
from gateway_tasks.core.stats import DISPATCHED, tier_field
from devtools import processes
from gateway_tasks.local.ports import free_port
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import IDEMPOTENCY_NAMESPACE, Gateway
from gateway_tasks.rest.app import create_app, sync_timeout_s
from gateway_tasks.rest.result_waiter import ResultWaiter


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("acme", "vip"), ("other", "vip")])


def queued(gw: Gateway) -> list[dict]:
    return queued_messages(gw.r, Keys(gw.settings.key_prefix), "default", "vip")


def with_sim(settings, sim, **changes):
    pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=600_000,
                rpm=6_000, timeout_s=30)
    return settings.with_(pools=(pool,), **changes)


def test_a_queued_task_is_removed_with_its_message_and_fails_as_cancelled(gw):
    keys = Keys(gw.settings.key_prefix)
    a, b, c = (gw.submit("acme", f"task {i}", max_tokens=5) for i in range(3))
    done = gw.cancel(b.id)
    assert (done.was, done.cancelled) == ("queued", True)
    assert [m["headers"]["id"] for m in queued(gw)] == [a.id, c.id]
    assert gw.r.hlen(keys.messages("default")) == 2 and gw.r.zcard(keys.index("default", "vip")) == 2
    with pytest.raises(TaskCancelled, match="never reached the upstream") as info:
        b.get(timeout=5)
    assert info.value.reason == "queued"
    assert gw.cancel(b.id).was == "already_cancelled"
    assert int(gw.r.hget(keys.stats("default"), "cancelled:vip")) == 1     # gateway_cancelled_tasks


def test_the_last_queued_task_of_a_tenant_takes_it_out_of_line(gw):
    keys = Keys(gw.settings.key_prefix)
    h = gw.submit("acme", "only one", max_tokens=5)
    assert gw.r.zscore(keys.active("default", "vip"), "acme") is not None
    gw.cancel(h.id)
    assert gw.r.zscore(keys.active("default", "vip"), "acme") is None
    assert gw.r.zcard(keys.index("default", "vip")) == 0


def test_the_enqueue_writes_the_tasks_ref_under_its_pool_and_a_refused_one_writes_none(gw):
    keys = Keys(gw.settings.key_prefix)
    h = gw.submit("acme", "where am I", max_tokens=5)
    raw = gw.r.get(keys.task_ref_in("default", h.id))
    assert raw is not None and gw.r.get(keys.task_ref(h.id)) is None      # not the old key
    ref = TaskRef.decode(raw)
    (entry,) = gw.r.zrange(keys.index("default", "vip"), 0, -1)
    assert (ref.pool, ref.tier, ref.tenant, ref.entry) == ("default", "vip", "acme", entry.decode())
    assert 0 < gw.r.pttl(keys.task_ref_in("default", h.id)) <= gw.settings.result_ttl_s * 1000
    assert read_refs(gw.r, keys, ["default"], [h.id, "no-such-task"]) == {h.id: ref}
    small = gw.settings.with_(tiers=tuple(t if t.name != "vip" else replace(t, queue_max_len=1)
                                          for t in gw.settings.tiers))   # full: its one task queued
    g2 = Gateway(small, client=gw.r)
    try:
        with pytest.raises(QueueFull):
            g2.submit("acme", "no room", max_tokens=5, idempotency_key="refused")
        refused = uuid.uuid5(IDEMPOTENCY_NAMESPACE, "acme:refused")
        assert gw.r.get(keys.task_ref_in("default", str(refused))) is None
    finally:
        g2.app.close()


def test_a_ref_an_earlier_producer_wrote_is_still_found(gw):
    keys = Keys(gw.settings.key_prefix)
    h = gw.submit("acme", "queued before the upgrade", max_tokens=5)
    raw = gw.r.get(keys.task_ref_in("default", h.id))
    gw.r.delete(keys.task_ref_in("default", h.id))
    gw.r.set(keys.task_ref(h.id), raw)                   # where earlier producers wrote it
    assert gw.cancel(h.id).was == "queued"
    assert gw.r.zcard(keys.index("default", "vip")) == 0


def test_only_the_owner_may_cancel(gw):
    h = gw.submit("acme", "mine", max_tokens=5)
    with pytest.raises(UnknownTask):
        gw.cancel(h.id, "other")
    with pytest.raises(UnknownTask):
        gw.cancel("no-such-task")
    assert len(queued(gw)) == 1
    assert gw.cancel(h.id, "acme").was == "queued"


def test_rest_delete_owner_only_then_the_task_shows_cancelled(gw):
    key, other_key = gw.register_tenant("acme", "vip"), gw.register_tenant("other", "vip")
    with TestClient(create_app(gw)) as client:
        task_id = client.post("/v1/tasks", json={"messages": [{"role": "user", "content": "hi"}]},
                              headers={"Authorization": f"Bearer {key}"}).json()["task_id"]
        res = client.delete(f"/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {other_key}"})
        assert res.status_code == 404 and res.json()["error"]["type"] == "NotFound"
        assert len(queued(gw)) == 1
        res = client.delete(f"/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {key}"})
        assert res.status_code == 200 and res.json() == {"task_id": task_id, "cancelled": True, "was": "queued"}
        view = client.get(f"/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {key}"}).json()
        assert view["status"] == states.FAILURE
        assert view["error"]["type"] == "TaskCancelled" and view["error"]["reason"] == "queued"
        done = gw.submit("acme", "finished", max_tokens=5)
        gw.app.backend.store_result(done.id, {"response": {}}, states.SUCCESS)
        res = client.delete(f"/v1/tasks/{done.id}", headers={"Authorization": f"Bearer {key}"})
        assert res.status_code == 409 and res.json()["error"]["type"] == "TaskFinished"
        assert client.delete("/v1/tasks/x", headers={}).status_code == 401
    assert queued(gw) == [m for m in queued(gw) if m["headers"]["id"] == done.id]


def test_cli_task_cancel(gw, monkeypatch, capsys):
    monkeypatch.setattr(task_cli, "get_settings", lambda: gw.settings)
    parser = argparse.ArgumentParser()
    task_cli.register(parser.add_subparsers(dest="command"))
    h = gw.submit("acme", "by the operator", max_tokens=5)
    args = parser.parse_args(["task", "cancel", h.id])
    assert args.func(args) == 0
    assert '"was": "queued"' in capsys.readouterr().out
    assert queued(gw) == []
    with pytest.raises(UnknownTask):
        args = parser.parse_args(["task", "cancel", h.id, "--tenant", "other"])
        args.func(args)


@pytest.mark.parametrize("deadline_s,headers,expected", [
    (None, {}, 30.0), (5.0, {}, 5.0), (None, {"X-Stainless-Timeout": "15"}, 14.5),
    (10.0, {"X-Stainless-Timeout": "600"}, 10.0), (None, {"X-Gateway-Timeout": "0.2"}, 0.5),
    (None, {"X-Stainless-Timeout": "soon"}, 30.0)])
def test_sync_timeout_follows_the_client(deadline_s, headers, expected):
    assert sync_timeout_s(deadline_s, headers) == expected


def test_result_wait_stops_when_the_client_is_gone(gw):
    h = gw.submit("acme", "nobody waits", max_tokens=5)

    async def gone() -> bool:
        return True

    async def wait() -> object:
        waiter = ResultWaiter.for_backend(gw.app.backend, gw.settings.redis_url)
        try:
            return await waiter.wait(h.id, 30.0, gone)
        finally:
            await waiter.close()
    started = time.monotonic()
    assert asyncio.run(wait()) is None
    assert time.monotonic() - started < 5


def test_sync_completion_that_times_out_cancels_its_task(gw):
    key = gw.register_tenant("acme", "vip")
    with TestClient(create_app(gw)) as client:        # no worker: it cannot complete
        res = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                          headers={"Authorization": f"Bearer {key}", "X-Gateway-Timeout": "1.5"})
    assert res.status_code == 504
    err = res.json()["error"]
    assert err["type"] == "Timeout" and err["cancelled"] is True and err["was"] == "queued"
    assert queued(gw) == []


def test_a_client_that_disconnects_cancels_its_sync_task(gw):
    key = gw.register_tenant("acme", "vip")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(gw), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(httpx.ReadTimeout):       # the client gives up after 1 s (no worker)
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=1.0,
                       json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"Authorization": f"Bearer {key}"})
        deadline = time.monotonic() + 10
        while queued(gw) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queued(gw) == []                        # cancelled well before the 30 s wait ends
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.slow
def test_cancelled_running_task_discards_its_result(settings, r, tmp_path):
    with SimulatorThread(SimConfig(base_latency_ms=2_000)) as sim:
        s = with_sim(settings, sim)
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            h = gw.submit("acme", "slow", max_tokens=5)
            keys = Keys(s.key_prefix)
            deadline = time.monotonic() + 20
            while r.hlen(keys.dispatched("default")) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert gw.cancel(h.id).was == "running"
            with pytest.raises(TaskCancelled) as info:
                h.get(timeout=30)
            time.sleep(2.5)                       # the call in flight finishes meanwhile
            with pytest.raises(TaskCancelled):
                gw.result(h.id).get(timeout=5)    # and its success did not replace the cancel
        finally:
            worker.stop()
    assert info.value.reason == "running"
    assert r.hlen(keys.dispatched("default")) == 0


@pytest.mark.slow
def test_a_cancelled_task_is_not_resurrected_after_its_worker_is_killed(settings, r, tmp_path):
    with SimulatorThread(SimConfig(base_latency_ms=30_000)) as sim:      # still running at the kill
        s = with_sim(settings, sim, lease_s=1.0)
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        keys = Keys(s.key_prefix)
        doomed = processes.worker(s, concurrency=2, name="doomed", log_path=str(tmp_path / "w1.log")).start()
        survivor = None
        try:
            processes.wait_for_workers(gw.app, 1)
            h = gw.submit("acme", "to be cancelled", max_tokens=5)
            deadline = time.monotonic() + 20
            while r.hlen(keys.dispatched("default")) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(1.0)                                 # in its 30 s upstream call now
            assert gw.cancel(h.id).was == "running"
            time.sleep(1.5)                                 # the doomed dispatcher flushes its tallies
            before = int(r.hget(keys.stats("default"), tier_field(DISPATCHED, "vip")) or 0)
            doomed.kill()                                   # SIGKILL: no ack, its lease runs out
            survivor = processes.worker(s, concurrency=2, name="survivor",
                                        log_path=str(tmp_path / "w2.log")).start()
            processes.wait_for_workers(gw.app, 1)
            deadline = time.monotonic() + 15
            while r.hlen(keys.dispatched("default")) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(3 * s.lease_s)                       # a few sweeps more
        finally:
            if survivor:
                survivor.stop()                             # flushes its dispatch tallies
            doomed.stop()
    dispatched = int(r.hget(keys.stats("default"), tier_field(DISPATCHED, "vip")) or 0)
    assert r.hlen(keys.dispatched("default")) == 0 and queued(gw) == []
    assert r.hlen(keys.messages("default")) == 0
    assert dispatched == before <= 1                        # swept and dropped, never dispatched again
    assert "cancelled, dropped" in (tmp_path / "w2.log").read_text()
    assert int(r.hget(keys.inflight("default"), "acme") or 0) == 0
    with pytest.raises(TaskCancelled):
        h.get(timeout=5)


@pytest.mark.slow
def test_a_cancelled_task_is_not_retried(settings, r, tmp_path):
    """A task that keeps failing is requeued on its retry budget (vip: 5 retries); once
    cancelled, neither the requeue nor the next pick calls the upstream again."""
    with SimulatorThread(SimConfig(fail_rate=1.0, base_latency_ms=300)) as sim:   # every call: 500
        s = with_sim(settings, sim)
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            h = gw.submit("acme", "always fails", max_tokens=5)
            deadline = time.monotonic() + 20
            while int(r.get(Keys(s.key_prefix).attempts(h.id)) or 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            at_cancel = sim.stats()["requests_error"]
            assert gw.cancel(h.id).cancelled
            with pytest.raises(TaskCancelled):
                h.get(timeout=30)
            time.sleep(1.0)                               # a retry would have happened by now
            calls = sim.stats()["requests_error"]
        finally:
            worker.stop()
    assert 1 <= at_cancel and calls <= at_cancel + 1 < 6   # at most the call in flight at the cancel
