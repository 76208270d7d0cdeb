"""Sending a ``gateway.infer`` task: the producer's lean path to its queue.

Celery's ``send_task`` builds the task's message, acquires a producer from its pool, runs it
through kombu's channel -- which ends in ``gateway_tasks.dispatch.publish`` -- and then
publishes the task-sent event on a connection of its own: about half the CPU of a submit,
and one more round trip.  ``send_infer`` writes the same message (Celery's task protocol 2
in kombu's Redis envelope, field for field: ``tests/test_lean_publish.py`` holds it to what
``send_task`` writes) and the same task-sent event, and hands both to
``dispatch.publish``: the enqueue publishes the event in the same call, once the task is
queued (a refused task sends none, as with Celery) -- or, when Celery's broker is a control
Redis of its own, on that Redis once the task is queued.

What it leaves out is what the gateway does not use: task routes (the queue is given),
Celery's ``before_task_publish`` / ``after_task_publish`` signals, and the publish retries
of kombu's ``Connection.ensure`` (the Redis client's own retries stand in for them).  Every
way a gateway.infer task is sent goes through it: a submit, a task released by its
dependencies (``gateway_tasks.lifecycle.depends``) or by the load level
(``gateway_tasks.overload.deferral``).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
import uuid
from functools import lru_cache
from typing import Any

import redis
from celery import Celery
from celery.utils.time import utcoffset

from gateway_tasks.core.celery_app import TASK_NAME, settings_of
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.redis_client import shared_client
from gateway_tasks.dispatch.publish import publish

TASK_DELIVERY_MODE = 2    # persistent, as Celery's task messages
EVENT_DELIVERY_MODE = 1   # transient, as Celery's events
SENT_EVENT = "task-sent"
SENT_ROUTING_KEY = "task.sent"
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
# the JSON separators of kombu's and Celery's encoder (the same bytes as their messages)
_dumps = json.JSONEncoder(separators=(", ", ": ")).encode


@lru_cache(maxsize=4)
def _nodename(pid: int) -> str:
    """Celery's name of a process that is not a worker ('gen<pid>@<host>': ``anon_nodename``)."""
    return f"gen{pid}@{socket.gethostname()}"


@lru_cache(maxsize=32)
def event_channel(key_prefix: str, redis_url: str, exchange: str) -> str:
    """The pub/sub channel Celery's task-sent events go to on kombu's Redis transport: the key
    prefix, then '/<db>.<exchange>/task.sent' (kombu's fanout topic with its patterns on)."""
    db = redis.connection.parse_url(redis_url).get("db", 0) or 0
    return f"{key_prefix}/{db}.{exchange}/{SENT_ROUTING_KEY}"


def _properties(properties: dict[str, Any], exchange: str, routing_key: str, delivery_mode: int) -> dict[str, Any]:
    """kombu's message properties: the given ones, then its delivery fields and a new tag."""
    return {**properties, "delivery_mode": delivery_mode,
            "delivery_info": {"exchange": exchange, "routing_key": routing_key},
            "priority": 0, "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())}


def _envelope(body: Any, headers: dict[str, Any], properties: dict[str, Any]) -> str:
    """kombu's Redis message around a JSON body (base64, as kombu encodes it), as JSON."""
    return _dumps({"body": base64.b64encode(_dumps(body).encode("utf-8")).decode("ascii"),
                   "content-encoding": "utf-8", "content-type": "application/json", "headers": headers,
                   "properties": properties})


def task_message(app: Celery, task_id: str, queue: str, body: dict[str, Any], headers: dict[str, Any],
                 argsrepr: str) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
    """The task's message as Celery's ``send_task`` makes it -- (its headers and properties,
    the whole message as JSON, the task-sent event's fields or None when the app sends none)."""
    origin = _nodename(os.getpid())
    task_headers = {
        "lang": "py", "task": TASK_NAME, "id": task_id, "shadow": None, "eta": None, "expires": None,
        "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
        "root_id": task_id, "parent_id": None, "argsrepr": argsrepr, "kwargsrepr": "{}", "origin": origin,
        "ignore_result": None, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
        **headers}
    properties = _properties({"correlation_id": task_id, "reply_to": app.thread_oid, "argsrepr": argsrepr,
                              "kwargsrepr": "{}"}, "", queue, TASK_DELIVERY_MODE)
    message_json = _envelope([[body], {}, EMBED], task_headers, properties)
    sent = None
    if app.conf.task_send_sent_event:
        sent = {"hostname": origin, "utcoffset": utcoffset(), "pid": os.getpid(), "clock": app.clock.forward(),
                "uuid": task_id, "root_id": task_id, "parent_id": None, "name": TASK_NAME, "args": argsrepr,
                "kwargs": "{}", "retries": 0, "eta": None, "expires": None, "queue": queue, "exchange": "",
                "routing_key": queue, "timestamp": time.time(), "type": SENT_EVENT}
    return {"headers": task_headers, "properties": properties}, message_json, sent


def sent_event_message(app: Celery, sent: dict[str, Any]) -> str:
    """The task-sent event as Celery's event dispatcher publishes it (kombu's message, as JSON)."""
    return _envelope(sent, {"hostname": sent["hostname"]},
                     _properties({}, app.conf.event_exchange, SENT_ROUTING_KEY, EVENT_DELIVERY_MODE))


def send_infer(app: Celery, client: redis.Redis, task_id: str, queue: str, body: dict[str, Any],
               headers: dict[str, Any], argsrepr: str) -> None:
    """Queue one gateway.infer task on its gateway queue, with its task-sent event, in one round
    trip (``gateway_tasks.dispatch.publish``: QueueFull / InvalidRequest when it is refused)."""
    settings = settings_of(app)
    message, message_json, sent = task_message(app, task_id, queue, body, headers, argsrepr)
    channel = event = ""
    if sent is not None:
        channel = event_channel(settings.key_prefix, app.conf.broker_url, app.conf.event_exchange)
        event = sent_event_message(app, sent)
    # Celery's events live on its broker: the deployment's Redis, or a control Redis of their own
    # (``control_redis_url``, beside a Redis Cluster) -- then the event follows the enqueue there
    apart = bool(settings.control_redis_url) and settings.control_redis_url != settings.redis_url
    publish(client, Keys(settings.key_prefix), settings, queue, message, message_json=message_json,
            event_channel="" if apart else channel, event="" if apart else event)
    if apart and channel:
        shared_client(app.conf.broker_url).publish(channel, event)
