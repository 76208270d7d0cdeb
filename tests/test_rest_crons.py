"""REST for tenant crons over real HTTP (uvicorn on a loopback port, real Redis):
create/update/list/get/delete for the calling tenant, the jitter offset and both
next times in the reply, another tenant's cron answering 404, bad input 400,
no key 401, and the routes in the OpenAPI schema."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx
import pytest

from devtools.api_thread import ApiThread

from beat.jitter import jitter_offset_s
from beat.store import CronStore

BODY = {"task_id": "digest", "cron": "0 * * * *", "messages": "Summarise the news",
        "max_tokens": 64}


@pytest.fixture
def api(gateway):
    with ApiThread(gateway) as server:
        with httpx.Client(base_url=server.root_url, timeout=10.0) as http:
            yield http


@pytest.fixture
def keys(gateway):
    return {"pro": gateway.register_tenant("acme", "normal"),
            "free": gateway.register_tenant("tiny", "batch"),
            "vip": gateway.register_tenant("bigco", "vip")}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def parse(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def test_create_reports_jitter_nominal_and_actual_next(api, keys, r, settings):
    resp = api.post("/v1/crons", json=BODY, headers=auth(keys["pro"]))
    assert resp.status_code == 201, resp.text
    row = resp.json()
    assert resp.headers["Location"] == "/v1/crons/digest"
    expected = jitter_offset_s("acme", "digest", settings.tier("normal").jitter_window_s, 3600)
    assert row["tenant_id"] == "acme" and row["task_id"] == "digest" and row["tier"] == "normal"
    assert row["cron"] == "0 * * * *" and row["jitter_offset_s"] == expected
    nominal, actual = parse(row["nominal_next"]), parse(row["actual_next"])
    assert nominal.minute == 0 and nominal.second == 0
    assert actual - nominal == timedelta(seconds=expected)
    assert row["last_fired"] is None and row["last_status"] is None
    stored = CronStore(r, settings).get("acme", "digest")
    assert stored is not None and stored.payload == {
        "messages": [{"role": "user", "content": "Summarise the news"}], "max_tokens": 64}


def test_update_is_200_and_list_and_get_show_own_crons_only(api, keys):
    assert api.post("/v1/crons", json=BODY, headers=auth(keys["pro"])).status_code == 201
    upd = api.post("/v1/crons", json={**BODY, "cron": "*/5 * * * *"}, headers=auth(keys["pro"]))
    assert upd.status_code == 200 and upd.json()["cron"] == "*/5 * * * *"
    assert api.post("/v1/crons", json={**BODY, "task_id": "other"},
                    headers=auth(keys["free"])).status_code == 201
    mine = api.get("/v1/crons", headers=auth(keys["pro"])).json()["crons"]
    assert [(c["tenant_id"], c["task_id"], c["cron"]) for c in mine] == [("acme", "digest", "*/5 * * * *")]
    theirs = api.get("/v1/crons", headers=auth(keys["free"])).json()["crons"]
    assert [(c["tenant_id"], c["task_id"]) for c in theirs] == [("tiny", "other")]
    assert api.get("/v1/crons", headers=auth(keys["vip"])).json() == {"crons": []}
    one = api.get("/v1/crons/digest", headers=auth(keys["pro"]))
    assert one.status_code == 200 and one.json() == mine[0]


def test_another_tenants_cron_is_404_for_get_and_delete(api, keys, r, settings):
    assert api.post("/v1/crons", json=BODY, headers=auth(keys["pro"])).status_code == 201
    for method in ("GET", "DELETE"):
        resp = api.request(method, "/v1/crons/digest", headers=auth(keys["free"]))
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["type"] == "NotFound"
    assert CronStore(r, settings).get("acme", "digest") is not None   # untouched
    gone = api.delete("/v1/crons/digest", headers=auth(keys["pro"]))
    assert gone.status_code == 204 and gone.content == b""
    assert CronStore(r, settings).get("acme", "digest") is None
    assert api.get("/v1/crons/digest", headers=auth(keys["pro"])).status_code == 404
    assert api.delete("/v1/crons/digest", headers=auth(keys["pro"])).status_code == 404


def test_vip_has_no_jitter_and_free_spreads_within_its_window(api, keys, settings):
    vip = api.post("/v1/crons", json=BODY, headers=auth(keys["vip"])).json()
    assert vip["jitter_offset_s"] == 0 and vip["nominal_next"] == vip["actual_next"]
    free = api.post("/v1/crons", json=BODY, headers=auth(keys["free"])).json()
    assert 0 <= free["jitter_offset_s"] < settings.tier("batch").jitter_window_s
    assert free["jitter_offset_s"] == jitter_offset_s("tiny", "digest", 600, 3600)


@pytest.mark.parametrize("body,fragment", [
    ({**BODY, "cron": "61 * * * *"}, "61 * * * *"),
    ({**BODY, "cron": "H * * * *"}, "hashed (H)"),
    ({**BODY, "cron": "* * *"}, "expected 5 fields"),
    ({**BODY, "task_id": "bad id!"}, "task_id"),
    ({**BODY, "messages": []}, "messages"),
    ({**BODY, "max_tokens": 0}, "max_tokens"),
    ({**BODY, "schedule": "x"}, "schedule"),
    ({k: v for k, v in BODY.items() if k != "cron"}, "cron"),
])
def test_bad_input_is_400_naming_the_problem_and_stores_nothing(api, keys, r, settings, body, fragment):
    resp = api.post("/v1/crons", json=body, headers=auth(keys["pro"]))
    assert resp.status_code == 400, resp.text
    assert fragment in resp.json()["error"]["message"]
    assert CronStore(r, settings).list("acme") == []


def test_without_a_valid_key_every_cron_route_is_401(api, keys):
    for method, path in (("POST", "/v1/crons"), ("GET", "/v1/crons"), ("GET", "/v1/crons/digest"),
                         ("DELETE", "/v1/crons/digest")):
        for headers in ({}, auth("gt-not-a-key")):
            resp = api.request(method, path, json=BODY if method == "POST" else None, headers=headers)
            assert resp.status_code == 401, (method, path, resp.text)


def test_openapi_documents_the_cron_routes_and_row(api):
    schema = api.get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths["/v1/crons"]) == {"get", "post"}
    assert set(paths["/v1/crons/{task_id}"]) == {"get", "delete"}
    post = paths["/v1/crons"]["post"]
    assert {"200", "201", "400"} <= set(post["responses"])
    assert "404" in paths["/v1/crons/{task_id}"]["delete"]["responses"]
    row = schema["components"]["schemas"]["CronRow"]["properties"]
    for name in ("jitter_offset_s", "nominal_next", "actual_next"):
        assert row[name].get("description"), name
    assert set(schema["components"]["schemas"]["CronRequest"]["required"]) == {"task_id", "cron", "messages"}
