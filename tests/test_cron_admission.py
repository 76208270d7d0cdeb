"""Cron registration is admitted like a submit of its payload and held to the tenant's
tier: huge prompts, unknown models, absurd max_tokens, invalid Unicode and a full Redis are
refused with a specific 4xx/503 JSON error before anything is stored; a tenant's cron count
and the fires per hour its crons imply are capped per tier, with the numbers in the error."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gateway_tasks.core.errors import InvalidRequest
from gateway_tasks.producer.memory_guard import MIB, MemoryGuard
from gateway_tasks.rest.app import create_app

from beat.admission import CronLimitExceeded, check_cron_set
from beat.api import register_cron
from beat.schedule import fires_per_hour, validate_cron

BODY = {"task_id": "digest", "cron": "0 * * * *",
        "messages": [{"role": "user", "content": "Summarise the news"}], "max_tokens": 64}


@pytest.fixture
def gw(make_gateway):
    return make_gateway()


@pytest.fixture
def api(gw):
    with TestClient(create_app(gw), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def keys(gw):
    return {"vip": gw.register_tenant("bigco", "vip"), "batch": gw.register_tenant("tiny", "batch")}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cron_keys(r, key_prefix) -> list[bytes]:
    return r.keys(f"{key_prefix}cron*")


@pytest.mark.parametrize("expr, per_hour", [
    ("* * * * *", 60), ("*/5 * * * *", 12), ("0 * * * *", 1), ("@hourly", 1), ("@daily", 1),
    ("0,30 9 * * 1", 2), ("15 3 15 * *", 1), ("0-9 */2 * * *", 10), ("@yearly", 1)])
def test_fires_per_hour(expr, per_hour):
    assert fires_per_hour(validate_cron(expr)) == per_hour


def test_cron_set_limits_name_the_numbers(settings):
    batch = settings.tier("batch")                # 5 crons, 10 tasks an hour
    check_cron_set(batch, "t", {f"c{i}": "0 * * * *" for i in range(5)})
    with pytest.raises(CronLimitExceeded, match=r"at most 5 crons .*would make 6") as exc:
        check_cron_set(batch, "t", {f"c{i}": "0 * * * *" for i in range(6)})
    assert exc.value.details() == {"limit": "max_crons_per_tenant", "allowed": 5, "requested": 6}
    with pytest.raises(CronLimitExceeded, match=r"up to 13 times in one hour.*max_tasks_per_hour of 10"
                                                r".*a '\*/5 \* \* \* \*' 12/h") as exc:
        check_cron_set(batch, "t", {"a": "*/5 * * * *", "b": "0 * * * *"})
    assert exc.value.details() == {"limit": "max_tasks_per_hour", "allowed": 10, "requested": 13}


def test_the_attack_many_crons_with_4mb_prompts_is_refused_before_redis_grows(api, keys, r, key_prefix,
                                                                                settings):
    """The attack: many POST /v1/crons with prompts just under the body limit.  Each is
    refused as a submit of it would be (413), and nothing of it is stored."""
    prompt = "lorem ipsum " * ((settings.max_request_bytes - 4096) // 12)
    for i in range(3):
        resp = api.post("/v1/crons", json={**BODY, "task_id": f"big{i}", "messages": prompt},
                        headers=auth(keys["vip"]))
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["type"] == "PromptTooLarge"
    assert cron_keys(r, key_prefix) == []


@pytest.mark.parametrize("change, status, type_, words", [
    ({"messages": "word " * 200_000}, 413, "PromptTooLarge", "exceeds the limit of"),   # 1 MB
    ({"model": "no-such-model"}, 400, "InvalidRequest", "no-such-model"),
    ({"max_tokens": 10**9}, 413, "PromptTooLarge", "max_tokens (1000000000)"),
    ({"messages": [{"role": "user", "content": "caf\ud800"}]}, 400, "InvalidRequest", "lone surrogate"),
])
def test_a_payload_a_submit_would_refuse_is_refused_at_registration(api, keys, r, key_prefix, change,
                                                                    status, type_, words):
    resp = api.post("/v1/crons", content=json.dumps({**BODY, **change}),    # \ud800 escaped as JSON has it
                    headers={**auth(keys["vip"]), "Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_ and words in error["message"]
    assert cron_keys(r, key_prefix) == []


def test_cron_count_and_hourly_fires_are_capped_per_tier(api, keys, r):
    h = auth(keys["batch"])                        # batch: 5 crons, 10 tasks an hour
    for i in range(5):
        assert api.post("/v1/crons", json={**BODY, "task_id": f"c{i}"}, headers=h).status_code == 201
    resp = api.post("/v1/crons", json={**BODY, "task_id": "c5"}, headers=h)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {
        "type": "CronLimitExceeded", "limit": "max_crons_per_tenant", "allowed": 5, "requested": 6,
        "message": resp.json()["error"]["message"]}
    # an update is no new cron, but its fires count: 4 x 1 + 12 > 10
    resp = api.post("/v1/crons", json={**BODY, "task_id": "c0", "cron": "*/5 * * * *"}, headers=h)
    assert resp.status_code == 400 and resp.json()["error"]["requested"] == 16, resp.text
    assert api.post("/v1/crons", json={**BODY, "task_id": "c0", "cron": "0,30 * * * *"},
                    headers=h).status_code == 200                                       # 4 + 2 = 6
    assert [c["cron"] for c in api.get("/v1/crons", headers=h).json()["crons"]][0] == "0,30 * * * *"


class FullRedis:
    """INFO memory of a Redis at its submit limit (the guard's only read)."""

    def info(self, section):
        return {"used_memory": 99 * MIB, "maxmemory": 100 * MIB}


def test_a_full_redis_refuses_registration_and_the_python_api_admits_like_rest(gw, api, keys, r, key_prefix,
                                                                               settings):
    gw.memory = MemoryGuard(FullRedis(), 0.9)
    resp = api.post("/v1/crons", json=BODY, headers=auth(keys["vip"]))
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "RedisFull", resp.text
    with pytest.raises(InvalidRequest, match="no-such-model"):
        register_cron(settings, r, "bigco", "digest", "0 * * * *",
                      {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"})
    assert cron_keys(r, key_prefix) == []
