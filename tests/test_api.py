"""The REST API against a real Redis, no worker: auth, submit (the task lands
in its tier's list), validation and error mapping, reading results (stored
with the Celery backend), the OpenAI-compatible endpoint, health and metrics."""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import uuid
from dataclasses import replace
from types import SimpleNamespace

import openai
import pytest
import redis
from fastapi.testclient import TestClient

from gateway_tasks.rest import cli as api_module
from gateway_tasks.cli import tenant as tenant_cli
from gateway_tasks.rest.app import create_app
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.core.keys import Keys, split_queue_name
from gateway_tasks.producer.gateway import IDEMPOTENCY_NAMESPACE, Gateway
from gateway_tasks.tenants.registry import TenantRegistry
from gateway_tasks.core.errors import DeadlineExceeded
from gateway_tasks.rest.limits import BodySizeLimit

HELLO = [{"role": "user", "content": "hello there"}]
ADMIN_KEY = "admin-" + "x" * 26


@pytest.fixture
def vip_key(gateway):
    return gateway.register_tenant("acme", "vip")


@pytest.fixture
def batch_key(gateway):
    return gateway.register_tenant("tiny", "batch")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def queue_len(gateway: Gateway, queue: str) -> int:
    tier, pool = split_queue_name(queue)
    return len(queued_messages(gateway.r, Keys(gateway.settings.key_prefix), pool, tier))


def task_id_for(tenant: str, idempotency_key: str) -> str:
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{tenant}:{idempotency_key}"))


# -- auth ------------------------------------------------------------------------
def test_missing_and_invalid_keys_are_401(client, vip_key):
    for headers in ({}, auth("gt-not-a-key"), {"Authorization": "Basic abc"}):
        resp = client.post("/v1/tasks", json={"messages": HELLO}, headers=headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["type"] == "Unauthorized"
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert client.get("/v1/tasks/x", headers=auth("nope")).status_code == 401


@pytest.mark.parametrize("headers", [{}, auth("gt-not-a-key"), {"Authorization": "Basic abc"}])
@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/tasks", {"json": {"messages": []}}),                      # schema error
    ("POST", "/v1/tasks", {"json": {"messages": HELLO, "max_tokens": 500_000}}),  # too large prompt
    ("POST", "/v1/tasks", {"content": b'{"messages": [', "headers": {"Content-Type": "application/json"}}),
    ("POST", "/v1/chat/completions", {"json": {"messages": HELLO, "stream": True}}),
    ("POST", "/v1/chat/completions", {"content": b"not json", "headers": {"Content-Type": "application/json"}}),
    ("GET", "/v1/tasks/no-such-task", {}),
    ("GET", "/v1/no-such-route", {}),
])
def test_authentication_comes_first(client, gateway, vip_key, headers, method, path, body):
    """A caller without a valid key gets 401 whatever is wrong with its request."""
    body = dict(body)
    resp = client.request(method, path, headers={**body.pop("headers", {}), **headers}, **body)
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["type"] == "Unauthorized"
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert queue_len(gateway, "gt.vip.default") == 0


def test_redis_down_while_authenticating_is_503(client, gateway, vip_key, monkeypatch):
    def down(api_key):
        raise redis.ConnectionError("connection refused")
    monkeypatch.setattr(gateway.tenants, "authenticate", down)
    resp = client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(vip_key))
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "ServiceUnavailable"
    assert resp.headers["Retry-After"] == "1"
    assert vip_key not in resp.text


def test_a_stale_api_key_index_entry_does_not_authenticate(client, gateway, vip_key):
    """The stored digest is compared (in constant time), not just the index looked up."""
    gateway.r.hset(Keys(gateway.settings.key_prefix).api_keys,
                   hashlib.sha256(b"gt-old-key").hexdigest(), "acme")
    assert client.post("/v1/tasks", json={"messages": HELLO}, headers=auth("gt-old-key")).status_code == 401
    assert client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(vip_key)).status_code == 202


# -- submit ----------------------------------------------------------------------
def test_submit_lands_in_the_tenants_tier_queue(client, gateway, vip_key, batch_key):
    resp = client.post("/v1/tasks", json={"messages": HELLO, "max_tokens": 32}, headers=auth(vip_key))
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["tier"] == "vip" and body["queue"] == "gt.vip.default"
    assert body["model"] == gateway.settings.pools[0].model
    assert body["prompt_tokens"] > 0 and body["est_tokens"] == body["prompt_tokens"] + 32
    assert body["status_url"] == f"/v1/tasks/{body['task_id']}"
    assert resp.headers["Location"] == body["status_url"]
    assert queue_len(gateway, "gt.vip.default") == 1

    resp = client.post("/v1/tasks", json={"messages": "a plain prompt"}, headers=auth(batch_key))
    assert resp.status_code == 202, resp.text
    assert resp.json()["queue"] == "gt.batch.default"
    assert queue_len(gateway, "gt.batch.default") == 1
    assert queue_len(gateway, "gt.vip.default") == 1


def test_idempotency_key_enqueues_once(client, gateway, vip_key):
    req = {"messages": HELLO, "idempotency_key": "order-42"}
    first = client.post("/v1/tasks", json=req, headers=auth(vip_key)).json()
    second = client.post("/v1/tasks", json=req, headers=auth(vip_key)).json()
    assert first["task_id"] == second["task_id"] == task_id_for("acme", "order-42")
    assert queue_len(gateway, "gt.vip.default") == 1


@pytest.mark.parametrize("payload,field", [
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": "12"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": HELLO, "temperature": 0.2}, "temperature"),
    ({"messages": HELLO, "deadline_s": -1}, "deadline_s"),
])
def test_schema_errors_are_400_naming_the_field(client, gateway, vip_key, payload, field):
    resp = client.post("/v1/tasks", json=payload, headers=auth(vip_key))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "ValidationError" and field in err["message"]
    assert queue_len(gateway, "gt.vip.default") == 0


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b'{"messages": [', b"not json", b'{"messages": "hi",}'])
def test_malformed_json_is_400(client, gateway, vip_key, path, raw):
    resp = client.post(path, content=raw,
                       headers={**auth(vip_key), "Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "ValidationError" and err["details"][0]["type"] == "json_invalid"
    assert queue_len(gateway, "gt.vip.default") == 0


@pytest.mark.parametrize("payload,status,type_", [
    ({"messages": HELLO, "model": "no-such-model"}, 400, "InvalidRequest"),
    ({"messages": [{"role": "user", "content": "   "}]}, 400, "ValidationError"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": " "}]}, 400,
     "ValidationError"),
    ({"messages": HELLO, "extra_body": {"stream": True}}, 400, "InvalidRequest"),
    ({"messages": HELLO, "max_tokens": 500_000}, 413, "PromptTooLarge"),
])
def test_gateway_errors_map_to_http(client, gateway, vip_key, payload, status, type_):
    resp = client.post("/v1/tasks", json=payload, headers=auth(vip_key))
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == type_ and err["message"]
    assert queue_len(gateway, "gt.vip.default") == 0


# -- body size limit ----------------------------------------------------------------
BIG = 20 * 1024 * 1024  # 20 MB


def padded(payload: dict, size: int) -> bytes:
    """payload as JSON of exactly size bytes (trailing whitespace is valid JSON)."""
    raw = json.dumps(payload).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def json_headers(key: str) -> dict[str, str]:
    return {**auth(key), "Content-Type": "application/json"}


@pytest.mark.parametrize("path", ["/v1/tasks", "/v1/chat/completions"])
def test_a_20_mb_body_is_rejected_with_413_before_parsing(client, gateway, vip_key, path):
    resp = client.post(path, content=padded({"messages": HELLO}, BIG), headers=json_headers(vip_key))
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert err["type"] == "RequestTooLarge" and "max_request_bytes" in err["message"]
    assert err["max_request_bytes"] == gateway.settings.max_request_bytes
    assert queue_len(gateway, "gt.vip.default") == 0


def test_a_chunked_20_mb_body_without_content_length_is_413(client, gateway, vip_key):
    chunks = (b" " * 1024 * 1024 for _ in range(20))
    resp = client.post("/v1/tasks", content=chunks, headers=json_headers(vip_key))
    assert "content-length" not in {k.lower() for k in resp.request.headers}
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["type"] == "RequestTooLarge"
    assert queue_len(gateway, "gt.vip.default") == 0


@pytest.mark.parametrize("headers", [{}, auth("gt-not-a-key")])
def test_an_unauthenticated_20_mb_body_is_401(client, gateway, vip_key, headers):
    resp = client.post("/v1/tasks", content=padded({"messages": HELLO}, BIG),
                       headers={**headers, "Content-Type": "application/json"})
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "Unauthorized"
    assert queue_len(gateway, "gt.vip.default") == 0


def test_a_body_of_exactly_the_limit_is_accepted_one_byte_more_is_not(client, gateway, vip_key):
    limit = gateway.settings.max_request_bytes
    resp = client.post("/v1/tasks", content=padded({"messages": HELLO}, limit),
                       headers=json_headers(vip_key))
    assert resp.status_code == 202, resp.text
    resp = client.post("/v1/tasks", content=padded({"messages": HELLO}, limit + 1),
                       headers=json_headers(vip_key))
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "RequestTooLarge"
    assert queue_len(gateway, "gt.vip.default") == 1


def run_asgi(app, chunks: list[bytes], headers: list[tuple[bytes, bytes]] = ()) -> list[dict]:
    """Drive an ASGI app with a body sent in chunks; returns what it sent."""
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": list(headers)}
    asyncio.run(app(scope, receive, send))
    return sent


def test_body_limit_counts_streamed_chunks():
    seen: list[bytes] = []

    async def echo(scope, receive, send):
        seen.append((await receive())["body"])

    limited = BodySizeLimit(echo, max_bytes=10, max_depth=64)
    sent = run_asgi(limited, [b"1234", b"5678", b"901"])   # 11 bytes, no Content-Length
    assert sent[0]["status"] == 413 and seen == []
    assert json.loads(sent[1]["body"])["error"]["type"] == "RequestTooLarge"
    assert run_asgi(limited, [b"1234", b"5678", b"90"]) == [] and seen == [b"1234567890"]
    sent = run_asgi(limited, [b"1"], [(b"content-length", b"11")])   # declared over: not read
    assert sent[0]["status"] == 413 and seen == [b"1234567890"]


def test_deleted_tenant_is_401_and_unknown_tenant_on_submit_is_404(client, gateway, vip_key,
                                                                   monkeypatch):
    # a tenant deleted between authentication and submit: the producer's UnknownTenant -> 404
    real_submit = gateway.submit
    with monkeypatch.context() as m:
        m.setattr(gateway, "submit", lambda tenant_id, *a, **kw: real_submit("ghost", *a, **kw))
        resp = client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(vip_key))
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "UnknownTenant"
    gateway.tenants.delete("acme")
    assert client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(vip_key)).status_code == 401


def test_full_queue_is_429_with_retry_after(r, settings):
    tiers = tuple(replace(t, queue_max_len=1) for t in settings.tiers)
    gw = Gateway(settings.with_(tiers=tiers))
    try:
        key = gw.register_tenant("acme", "normal")
        with TestClient(create_app(gw)) as c:
            assert c.post("/v1/tasks", json={"messages": HELLO}, headers=auth(key)).status_code == 202
            resp = c.post("/v1/tasks", json={"messages": HELLO}, headers=auth(key))
            assert resp.status_code == 429, resp.text
            assert resp.json()["error"]["type"] == "QueueFull"
            assert resp.headers["Retry-After"] == "30"  # normal tier's max_wait_ms, in seconds
            assert queue_len(gw, "gt.normal.default") == 1
            # a task the queue refused was never submitted: its id is unknown
            resp = c.post("/v1/tasks", json={"messages": HELLO, "idempotency_key": "k1"},
                          headers=auth(key))
            assert resp.status_code == 429
            assert c.get(f"/v1/tasks/{task_id_for('acme', 'k1')}", headers=auth(key)).status_code == 404
    finally:
        gw.app.close()
        gw.r.close()


# -- reading results ---------------------------------------------------------------
def _submit(client, key) -> str:
    resp = client.post("/v1/tasks", json={"messages": HELLO}, headers=auth(key))
    assert resp.status_code == 202, resp.text
    return resp.json()["task_id"]


def _request_of(tenant: str) -> SimpleNamespace:
    """What a worker passes to the backend (result_extended stores its args)."""
    return SimpleNamespace(task="gateway.infer", args=[{"tenant_id": tenant}], kwargs={},
                           hostname="w1", retries=0, delivery_info={}, children=[])


def test_pending_then_success_only_for_the_owner(client, gateway, vip_key, batch_key):
    task_id = _submit(client, vip_key)
    pending = client.get(f"/v1/tasks/{task_id}", headers=auth(vip_key)).json()
    assert (pending["task_id"], pending["status"], pending["state"]) == (task_id, "PENDING", "queued")
    assert client.get(f"/v1/tasks/{task_id}", headers=auth(batch_key)).status_code == 404

    gateway.app.backend.store_result(task_id, {"started": True}, "STARTED", request=_request_of("acme"))
    assert client.get(f"/v1/tasks/{task_id}", headers=auth(vip_key)).json()["status"] == "STARTED"
    assert client.get(f"/v1/tasks/{task_id}", headers=auth(batch_key)).status_code == 404

    result = {"task_id": task_id, "tenant_id": "acme", "response": {"id": "chatcmpl-1"},
              "tokens": {"total": 12}}
    gateway.app.backend.store_result(task_id, result, "SUCCESS")
    resp = client.get(f"/v1/tasks/{task_id}", headers=auth(vip_key))
    assert resp.status_code == 200
    assert {k: resp.json()[k] for k in ("task_id", "status", "result")} == {
        "task_id": task_id, "status": "SUCCESS", "result": result}
    other = client.get(f"/v1/tasks/{task_id}", headers=auth(batch_key))
    assert other.status_code == 404 and other.json()["error"]["type"] == "NotFound"


def test_unknown_and_other_tenants_task_ids_are_404_alike(client, gateway, vip_key, batch_key):
    queued = _submit(client, vip_key)
    unknown = str(uuid.uuid4())
    for task_id, key in ((unknown, vip_key), (unknown, batch_key), (queued, batch_key)):
        resp = client.get(f"/v1/tasks/{task_id}", headers=auth(key))
        assert resp.status_code == 404, resp.text
        assert resp.json() == {"error": {"type": "NotFound",
                                         "message": f"no task {task_id!r} for this tenant"}}
    assert client.get(f"/v1/tasks/{queued}", headers=auth(vip_key)).json()["status"] == "PENDING"


def test_a_result_that_outlived_its_owner_record_is_still_the_owners(client, gateway, vip_key,
                                                                     batch_key):
    task_id = _submit(client, vip_key)
    gateway.r.delete(Keys(gateway.settings.key_prefix).task_owner(task_id))
    gateway.app.backend.store_result(task_id, {"tenant_id": "acme", "response": {}}, "SUCCESS")
    assert client.get(f"/v1/tasks/{task_id}", headers=auth(vip_key)).json()["status"] == "SUCCESS"
    assert client.get(f"/v1/tasks/{task_id}", headers=auth(batch_key)).status_code == 404


def test_failure_shows_the_error_type_and_message(client, gateway, vip_key, batch_key):
    task_id = _submit(client, vip_key)
    gateway.app.backend.store_result(task_id, DeadlineExceeded("waited too long"), "FAILURE",
                                     request=_request_of("acme"))
    body = client.get(f"/v1/tasks/{task_id}", headers=auth(vip_key)).json()
    assert body["status"] == "FAILURE" and "result" not in body
    assert body["error"] == {"type": "DeadlineExceeded", "message": "waited too long"}
    assert client.get(f"/v1/tasks/{task_id}", headers=auth(batch_key)).status_code == 404


# -- OpenAI-compatible endpoint -----------------------------------------------------
COMPLETION = {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
              "choices": [{"index": 0, "finish_reason": "stop",
                           "message": {"role": "assistant", "content": "hi!"}}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}


def _store_success(gateway: Gateway, task_id: str, tenant: str = "acme") -> None:
    gateway.app.backend.store_result(task_id, {
        "task_id": task_id, "tenant_id": tenant, "tier": "vip", "response": COMPLETION,
        "timing": {"queue_wait_ms": 7}}, "SUCCESS")


def test_chat_completions_returns_the_upstream_body(client, gateway, vip_key):
    task_id = task_id_for("acme", "sync-1")
    _store_success(gateway, task_id)  # as if a worker had already answered
    resp = client.post("/v1/chat/completions", headers={**auth(vip_key), "Idempotency-Key": "sync-1"},
                       json={"model": "gpt-4o-mini", "messages": HELLO, "temperature": 0.1})
    assert resp.status_code == 200, resp.text
    assert resp.json() == COMPLETION
    assert resp.headers["X-Gateway-Task-Id"] == task_id
    assert resp.headers["X-Gateway-Queue-Wait-Ms"] == "7"
    # the task was enqueued with the unknown OpenAI field forwarded upstream
    [raw] = queued_messages(gateway.r, Keys(gateway.settings.key_prefix), "default", "vip")
    assert raw["headers"]["id"] == task_id
    args, _kwargs, _embed = json.loads(base64.b64decode(raw["body"]))
    assert args[0]["extra_body"] == {"temperature": 0.1} and args[0]["source"] == "api-sync"


def test_openai_sdk_can_point_at_the_gateway(client, gateway, vip_key):
    _store_success(gateway, task_id_for("acme", "sdk-1"))
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=vip_key, http_client=client,
                        max_retries=0)
    out = sdk.chat.completions.create(model="gpt-4o-mini", messages=HELLO, max_tokens=16,
                                      extra_body={"idempotency_key": "sdk-1"})
    assert out.choices[0].message.content == "hi!" and out.usage.total_tokens == 11


def test_chat_completions_times_out_with_the_task_id(client, gateway, vip_key):
    resp = client.post("/v1/chat/completions", headers=auth(vip_key),
                       json={"messages": HELLO, "deadline_s": 0.2})
    assert resp.status_code == 504, resp.text
    err = resp.json()["error"]
    assert err["type"] == "Timeout" and err["task_id"] in err["message"]
    assert err["status_url"] == f"/v1/tasks/{err['task_id']}"
    # nobody waits for it any more: cancelled, so it never spends upstream quota later
    assert err["cancelled"] is True and err["was"] == "queued"
    assert queue_len(gateway, "gt.vip.default") == 0


def test_chat_completions_failure_and_stream(client, gateway, vip_key):
    task_id = task_id_for("acme", "fail-1")
    gateway.app.backend.store_result(task_id, DeadlineExceeded("too late"), "FAILURE",
                                     request=_request_of("acme"))
    resp = client.post("/v1/chat/completions", headers=auth(vip_key),
                       json={"messages": HELLO, "idempotency_key": "fail-1"})
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "DeadlineExceeded"
    assert resp.json()["error"]["task_id"] == task_id
    # streamed: the response has started (200), so the failure is one SSE error event
    resp = client.post("/v1/chat/completions", headers=auth(vip_key),
                       json={"messages": HELLO, "stream": True, "idempotency_key": "fail-1"})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in resp.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 1 and events[0]["error"]["type"] == "DeadlineExceeded"
    assert events[0]["error"]["task_id"] == task_id
    resp = client.post("/v1/chat/completions", headers=auth(vip_key),
                       json={"messages": HELLO, "stream_options": {"include_usage": True}})
    assert resp.status_code == 400 and "stream_options" in resp.json()["error"]["message"]


# -- health, metrics, CLI -----------------------------------------------------------
def test_healthz_and_metrics(r, settings):
    gateway = Gateway(settings.with_(admin_key=ADMIN_KEY))
    client = TestClient(create_app(gateway))
    vip_key = gateway.register_tenant("acme", "vip")
    assert client.get("/healthz").json() == {"status": "ok"}
    _submit(client, vip_key)
    assert client.get("/metrics").status_code == 401            # the admin credential
    assert client.get("/metrics", headers=auth(vip_key)).status_code == 401
    resp = client.get("/metrics", headers=auth(ADMIN_KEY))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert 'gateway_queue_depth_messages{pool="default",queue="gt.vip.default",tier="vip"} 1.0' \
        in resp.text
    assert "gateway_tenants 1.0" in resp.text


def test_tenant_and_api_cli(r, settings, monkeypatch, capsys):
    monkeypatch.setattr(tenant_cli, "get_settings", lambda: settings)
    parser = argparse.ArgumentParser(prog="gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    tenant_cli.register(sub)
    api_module.register(sub)

    def run(*argv: str):
        args = parser.parse_args(argv)
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out)

    added = run("tenant", "add", "acme", "--tier", "enterprise", "--api-key", "gt-secret")
    assert added["tier"] == "vip" and added["api_key"] == "gt-secret"
    generated = run("tenant", "add", "bob", "--tier", "batch")["api_key"]
    registry = TenantRegistry(r, settings)
    assert registry.authenticate(generated).tenant_id == "bob"
    assert [t["tenant_id"] for t in run("tenant", "list")] == ["acme", "bob"]
    assert run("tenant", "delete", "bob") == {"deleted": "bob", "crons_deleted": 0, "tasks_cancelled": 0}
    assert [t["tenant_id"] for t in run("tenant", "list")] == ["acme"]

    args = parser.parse_args(["api", "--host", "0.0.0.0", "--port", "9000"])
    assert (args.host, args.port, args.func) == ("0.0.0.0", 9000, api_module._run)
