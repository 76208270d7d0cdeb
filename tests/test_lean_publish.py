"""The producer's lean path (gateway_tasks.dispatch.message.send_infer) against Celery's own
``send_task`` on a real Redis: the same message field for field, the same task-sent event on
the same channel, published by the enqueue itself -- and none for a task the queue refused."""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import uuid

import pytest
import redis

from gateway_tasks.core.celery_app import TASK_NAME
from gateway_tasks.core.errors import QueueFull
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.dispatch.message import event_channel, send_infer
from gateway_tasks.dispatch.request import InferenceRequest

# differ from message to message by design: the delivery tag is new each time
VOLATILE_PROPERTIES = {"delivery_tag"}
VOLATILE_EVENT = {"uuid", "root_id", "timestamp", "clock", "utcoffset"}


def request(tenant: str = "acme") -> InferenceRequest:
    return InferenceRequest(tenant_id=tenant, tier="vip", pool="default", model="gpt-4o-mini",
                            messages=[{"role": "user", "content": "hi"}], max_tokens=8, prompt_tokens=5,
                            est_tokens=13)


def send_both(gw, req: InferenceRequest) -> tuple[str, str]:
    """One task through Celery's send_task, one through send_infer; their ids."""
    queue = gw.settings.queue_name(req.tier, req.pool)
    celery_id, lean_id = str(uuid.uuid4()), str(uuid.uuid4())
    gw.app.send_task(TASK_NAME, args=[req.to_body()], task_id=celery_id, queue=queue,
                     headers=req.routing_headers(), argsrepr=req.argsrepr(), kwargsrepr="{}")
    send_infer(gw.app, gw.r, lean_id, queue, req.to_body(), req.routing_headers(), req.argsrepr())
    return celery_id, lean_id


def without_ids(message: dict, task_id: str) -> dict:
    text = json.dumps(message).replace(task_id, "<id>")
    out = json.loads(text)
    for name in VOLATILE_PROPERTIES:
        out["properties"].pop(name)
    return out


def test_the_lean_message_is_celerys_field_for_field(make_gateway):
    gw = make_gateway([("acme", "vip")])
    celery_id, lean_id = send_both(gw, request())
    by_id = {m["headers"]["id"]: m for m in queued_messages(gw.r, Keys(gw.settings.key_prefix), "default", "vip")}
    celery, lean = by_id[celery_id], by_id[lean_id]
    assert without_ids(lean, lean_id) == without_ids(celery, celery_id)
    assert base64.b64decode(lean["body"]) == base64.b64decode(celery["body"]).replace(
        celery_id.encode(), lean_id.encode())


def control_on_db_1(url: str) -> str:
    """The same server's db 1, as a control Redis of Celery's own (pub/sub spans the dbs)."""
    return url.rsplit("/", 1)[0] + "/1"


@pytest.mark.parametrize("control", [False, True], ids=["one Redis", "a control Redis"])
def test_the_task_sent_event_is_celerys_on_the_same_channel(make_gateway, settings, control):
    """With a control Redis (``control_redis_url``: Celery's broker and events apart from the
    queues) the event goes there, on the channel Celery's own dispatcher uses."""
    if control:
        settings = settings.with_(control_redis_url=control_on_db_1(settings.redis_url))
    gw = make_gateway([("acme", "vip")], settings=settings)
    channel = event_channel(gw.settings.key_prefix, gw.app.conf.broker_url, gw.app.conf.event_exchange)
    listener = redis.Redis.from_url(gw.settings.redis_url).pubsub()
    listener.psubscribe(f"{gw.settings.key_prefix}*")
    try:
        assert listener.get_message(timeout=2)["type"] == "psubscribe"
        celery_id, lean_id = send_both(gw, request())
        events = {}
        deadline = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < deadline:
            got = listener.get_message(timeout=1)
            if got and got["type"] == "pmessage":
                envelope = json.loads(got["data"])
                events[json.loads(base64.b64decode(envelope["body"]))["uuid"]] = (got["channel"].decode(), envelope)
    finally:
        listener.close()
    assert set(events) == {celery_id, lean_id}
    (celery_channel, celery), (lean_channel, lean) = events[celery_id], events[lean_id]
    assert lean_channel == celery_channel == channel
    bodies = [json.loads(base64.b64decode(e.pop("body"))) for e in (celery, lean)]
    for e in (celery, lean):
        e["properties"].pop("delivery_tag")
    assert lean == celery
    assert {k: v for k, v in bodies[1].items() if k not in VOLATILE_EVENT} == \
        {k: v for k, v in bodies[0].items() if k not in VOLATILE_EVENT}
    assert bodies[1]["uuid"] == bodies[1]["root_id"] == lean_id and bodies[1]["type"] == "task-sent"


def test_a_refused_task_sends_no_event(make_gateway, settings):
    tiers = tuple(t if t.name != "vip" else dataclasses.replace(t, queue_max_len=1) for t in settings.tiers)
    gw = make_gateway([("acme", "vip")], settings=settings.with_(tiers=tiers))
    channel = event_channel(gw.settings.key_prefix, gw.app.conf.broker_url, gw.app.conf.event_exchange)
    listener = redis.Redis.from_url(gw.settings.redis_url).pubsub()
    listener.subscribe(channel)
    req = request()
    queue = gw.settings.queue_name(req.tier, req.pool)
    try:
        assert listener.get_message(timeout=2)["type"] == "subscribe"
        send_infer(gw.app, gw.r, "first", queue, req.to_body(), req.routing_headers(), req.argsrepr())
        with pytest.raises(QueueFull):
            send_infer(gw.app, gw.r, "second", queue, req.to_body(), req.routing_headers(), req.argsrepr())
        seen = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            got = listener.get_message(timeout=0.2)
            if got and got["type"] == "message":
                seen.append(json.loads(base64.b64decode(json.loads(got["data"])["body"]))["uuid"])
    finally:
        listener.close()
    assert seen == ["first"]
