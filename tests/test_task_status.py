"""Where is my task: TaskNotFound for an unknown id (at once, no exit-time noise), a queued
task's place in line and expected start against a known queue, why it waits, a cron run's
nominal time, a finished task's degradation; `gateway task show|list|result`.  Real Redis."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from beat.fire import run_key
from gateway_tasks.cli import task as task_cli
from gateway_tasks.core.errors import TaskNotFound
from gateway_tasks.dispatch.position import OtherLine, expected_wait_s, tier_ahead, tier_rate_per_s
from gateway_tasks.producer.where import (BEHIND_OWN, FAIR_SHARE, NEXT, TENANT_AT_CAP, TIER_SHARE, list_tasks,
                                          task_status)
from gateway_tasks.rest.app import create_app
from fastapi.testclient import TestClient

PROMPT = "where is my task"


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("a", "vip"), ("b", "vip"), ("c", "vip"), ("n", "normal")])


def _submit(gw, tenant, n, **kw):
    return [gw.submit(tenant, PROMPT, max_tokens=16, **kw) for _ in range(n)]


def test_an_unknown_id_is_task_not_found_at_once(gw):
    started = time.monotonic()
    with pytest.raises(TaskNotFound):
        gw.result("no-such-task")
    handle = _submit(gw, "a", 1)[0]
    gone = type(handle)("no-such-task", "a", "vip", handle.queue, handle.model, 1, 1, gw.app)
    with pytest.raises(TaskNotFound):
        gone.get(timeout=30)
    with pytest.raises(TaskNotFound):
        task_status(gw, handle.id, "b")          # another tenant's id looks the same as none
    assert time.monotonic() - started < 10       # no wait on any of them (30 s timeout above)
    assert gw.result(handle.id).id == handle.id


def test_a_timed_out_get_leaves_no_noise_at_exit(settings):
    code = f"""
import json
from gateway_tasks.core.settings import settings_from_json
from gateway_tasks.producer.gateway import Gateway
from celery.exceptions import TimeoutError
gw = Gateway(settings_from_json({json.dumps(json.dumps(json.loads(_settings_json(settings))))}))
gw.register_tenant("a", "vip")
h = gw.submit("a", "pending forever", max_tokens=4)
try:
    h.get(timeout=0.3)
except TimeoutError:
    print("timed out")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "timed out"
    assert "Exception ignored" not in done.stderr and "meta_path" not in done.stderr, done.stderr


def _settings_json(settings) -> str:
    from gateway_tasks.core.settings import settings_to_json
    return settings_to_json(settings)


@pytest.mark.parametrize("own_ahead,others,expected", [
    (0, [], 0),
    (2, [OtherLine("b", 3, 1.0, 100), OtherLine("c", 1, 1.0, 100)], 5),     # 2 of b's, c's one
    (0, [OtherLine("b", 9, 1.0, 100)], 0),                                  # a tie: not ahead
    (1, [OtherLine("b", 9, 2.0, 100)], 4),                                  # b weighs 2: 3 of its tasks
    (1, [OtherLine("b", 9, 1.0, 400)], 1),                                  # b's tasks 4x larger
    (3, [OtherLine("b", 2, 1.0, 100)], 5),                                  # b has only 2
])
def test_tier_ahead_is_weighted_fair_sharing_by_tokens(own_ahead, others, expected):
    assert tier_ahead(own_ahead, 100, 1.0, others) == expected


def test_rates_and_waits():
    samples = [{"ts_ms": 20_000, "tiers": {"vip": {"dispatched": 50}}},
               {"ts_ms": 10_000, "tiers": {"vip": {"dispatched": 30}}}]
    assert tier_rate_per_s(samples, "vip") == 2.0
    assert tier_rate_per_s(samples[:1], "vip") is None
    assert expected_wait_s(6, 2.0, 0, 0, None) == 3.0
    assert expected_wait_s(6, 2.0, 8, 2, 1.5) == 6.0       # its own line through its cap of 2


def test_position_eta_and_reasons_against_a_known_queue(gw):
    a = _submit(gw, "a", 5)
    _submit(gw, "b", 3)
    _submit(gw, "c", 1)
    view = task_status(gw, a[2].id, "a")
    assert (view["state"], view["tier"], view["lane"], view["pool"]) == ("queued", "vip", "interactive", "default")
    assert view["position"] == {"in_tier": 5, "tier_queued": 9, "own": 2, "own_queued": 5}
    assert view["expected_start"]["basis"] == "capacity"        # no controller samples yet
    assert view["waiting"]["reasons"] == [BEHIND_OWN, FAIR_SHARE]
    assert task_status(gw, a[0].id)["position"]["in_tier"] == 0
    assert task_status(gw, a[0].id)["waiting"]["reason"] == NEXT

    # the controller's samples: 20 vip tasks dispatched in 10 s -> 2/s -> 5 ahead = 2.5 s
    now_ms = int(time.time() * 1000)
    for ts, n in ((now_ms - 10_000, 30), (now_ms, 50)):
        gw.r.lpush(gw.keys.overload_samples, json.dumps({"ts_ms": ts, "tiers": {"vip": {"dispatched": n}}}))
    start = task_status(gw, a[2].id, "a")["expected_start"]
    assert (start["basis"], start["rate_per_s"], start["wait_s"]) == ("measured", 2.0, 2.5)

    _submit(gw, "n", 1)                                           # another tier has work: its share
    gw.r.hset(gw.keys.parked("default"), "a", "vip")              # a at its concurrency cap
    reasons = task_status(gw, a[2].id, "a")["waiting"]["reasons"]
    assert reasons[:2] == [TENANT_AT_CAP, TIER_SHARE]


def test_scheduled_cron_run_and_finished_degraded(gw):
    cron = gw.submit("a", PROMPT, max_tokens=8, source="cron", count_quota=False,
                     idempotency_key=run_key("digest", 1_700_000_000_000, "secret"),
                     cron_run=("digest", 1_700_000_000_000))
    gw.r.hset(gw.keys.cron("digest"), "jitter_offset_s", 42)
    view = task_status(gw, cron.id, "a")
    assert view["lane"] == "scheduled"
    assert view["cron"] == {"entry_id": "digest", "nominal_ms": 1_700_000_000_000, "jitter_offset_s": 42}

    done = _submit(gw, "b", 1)[0]
    overload = {"level_at_submit": 2, "level_at_dispatch": 2, "changed": True,
                "max_tokens": {"requested": 512, "used": 256, "capped": True},
                "model": {"requested": "gpt-4o", "used": "gpt-4o", "substituted": False},
                "pool": {"requested": "default", "used": "default", "failover": False}}
    gw.app.backend.store_result(done.id, {"tenant_id": "b", "tier": "vip", "lane": "interactive",
                                          "overload": overload, "response": {}}, "SUCCESS")
    view = task_status(gw, done.id, "b")
    assert view["state"] == "succeeded"
    assert view["degraded"] == {"level_at_submit": 2, "level_at_dispatch": 2,
                                "max_tokens": overload["max_tokens"]}


def test_rest_view_and_404(gw):
    key = gw.register_tenant("a", "vip")
    with TestClient(create_app(gw)) as client:
        task_id = client.post("/v1/tasks", json={"messages": [{"role": "user", "content": PROMPT}]},
                              headers={"Authorization": f"Bearer {key}"}).json()["task_id"]
        got = client.get(f"/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {key}"}).json()
        assert got["state"] == "queued" and got["position"]["own"] == 0
        missing = client.get("/v1/tasks/nope", headers={"Authorization": f"Bearer {key}"})
        assert missing.status_code == 404


def test_cli_show_list_result(gw, monkeypatch, capsys):
    monkeypatch.setattr(task_cli, "get_settings", lambda: gw.settings)
    parser = argparse.ArgumentParser()
    task_cli.register(parser.add_subparsers(dest="command"))

    def run(*argv):
        args = parser.parse_args(["task", *argv])
        status = args.func(args)
        return status, json.loads(capsys.readouterr().out)

    first, second = _submit(gw, "a", 2)
    gw.app.backend.store_result(first.id, {"tenant_id": "a", "tier": "vip", "response": {"id": "x"}}, "SUCCESS")
    status, shown = run("show", second.id, "--tenant", "a")
    assert status == 0 and shown["state"] == "queued"
    assert run("list", "--tenant", "a")[1] == [
        {"task_id": second.id, "submitted_ms": list_tasks(gw, "a")[0]["submitted_ms"], "status": "PENDING",
         "tier": "vip", "state": "queued"},
        {"task_id": first.id, "submitted_ms": list_tasks(gw, "a")[1]["submitted_ms"], "status": "SUCCESS",
         "tier": "vip", "state": "succeeded"}]
    assert [t["task_id"] for t in run("list", "--tenant", "a", "--state", "succeeded")[1]] == [first.id]
    assert run("result", first.id) == (0, {"tenant_id": "a", "tier": "vip", "response": {"id": "x"}})
    assert run("result", second.id)[0] == 1
    with pytest.raises(TaskNotFound):
        run("show", second.id, "--tenant", "b")
