"""A tenant id is an identity, not a name: deleting a tenant deletes its crons and cancels
its unfinished tasks, and the id registered again (a new generation) sees nothing the old
one owned -- its tasks answer like unknown ids (view, cancel, even once the owner record
is gone), its crons are not listed, counted or fired, and its idempotency keys start over."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway_tasks.core.errors import UnknownTask
from gateway_tasks.rest.app import create_app

from beat.api import delete_tenant
from beat.engine import CronEngine
from beat.store import CronStore

CRON = {"task_id": "digest", "cron": "0 * * * *", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16}


@pytest.fixture
def gw(make_gateway):
    return make_gateway()


@pytest.fixture
def api(gw):
    with TestClient(create_app(gw), raise_server_exceptions=False) as c:
        yield c


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_deleting_a_tenant_removes_its_crons_and_cancels_its_work_and_the_new_one_sees_none(gw, api, r):
    old = auth(gw.register_tenant("acme", "normal"))
    task = api.post("/v1/tasks", json={"messages": "hello", "idempotency_key": "k1"}, headers=old).json()["task_id"]
    assert api.post("/v1/crons", json=CRON, headers=old).status_code == 201

    assert delete_tenant(gw.settings, r, "acme", gateway=gw) == {
        "deleted": "acme", "crons_deleted": 1, "tasks_cancelled": 1}
    error = gw.result(task).backend.get_task_meta(task)["result"]
    assert "its tenant 'acme' was deleted" in str(error)

    new = auth(gw.register_tenant("acme", "normal"))
    assert api.get(f"/v1/tasks/{task}", headers=new).status_code == 404
    assert api.delete(f"/v1/tasks/{task}", headers=new).status_code == 404
    with pytest.raises(UnknownTask):
        gw.cancel(task, "acme")
    assert api.get("/v1/crons", headers=new).json() == {"crons": []}
    # the same idempotency key is the new generation's own task, not the old one's
    again = api.post("/v1/tasks", json={"messages": "hello", "idempotency_key": "k1"}, headers=new)
    assert again.status_code == 202 and again.json()["task_id"] != task
    assert api.get(f"/v1/tasks/{again.json()['task_id']}", headers=new).json()["status"] == "PENDING"
    r.delete(gw.keys.task_owner(task))        # the owner record expired; the result is still there
    assert api.get(f"/v1/tasks/{task}", headers=new).status_code == 404


class Recorder:
    def __init__(self):
        self.fired: list[str] = []

    def __call__(self, entry, nominal_ms):
        self.fired.append(entry.entry_id)
        return "task"


def test_crons_of_an_earlier_generation_are_not_listed_counted_or_fired(gw, r, settings):
    """The registry deleted alone (not through beat.api.delete_tenant): the old crons belong
    to no one the id names now, and beat deletes them when they come due."""
    gw.register_tenant("tiny", "batch")                          # batch: 5 crons
    store = CronStore(r, settings, gw)
    now = 1_704_067_200_000 - 10_000
    for i in range(5):
        store.add("tiny", f"c{i}", "0 * * * *", {"messages": CRON["messages"]}, now=now)
    gw.tenants.delete("tiny")
    gw.register_tenant("tiny", "batch")
    assert store.list("tiny") == [] and store.get("tiny", "c0") is None
    r.hset(gw.keys.cron("tiny:c0"), "last_task_id", "old-task")     # the old c0's history
    store.add("tiny", "c0", "0 * * * *", {"messages": CRON["messages"]}, now=now)   # the cap: 1 of 5
    assert store.get("tiny", "c0").last_task_id is None
    for i in range(1, 5):
        store.add("tiny", f"n{i}", "0 * * * *", {"messages": CRON["messages"]}, now=now)
    assert [e.task_id for e in store.list("tiny")] == ["c0", "n1", "n2", "n3", "n4"]
    fire = Recorder()
    report = CronEngine(r, settings, fire, tick_interval_s=5.0).run_due(now + 10_000 + 600_000)
    assert sorted(fire.fired) == ["tiny:c0", "tiny:n1", "tiny:n2", "tiny:n3", "tiny:n4"]
    assert report.statuses["unknown_tenant"] == 4                # the old c1..c4, skipped and deleted
    assert sorted(e.task_id for e in store.list()) == ["c0", "n1", "n2", "n3", "n4"]
