"""The result backend's one-round-trip write (lua/core/result_store.lua via ResultBackend), on a
real Redis: a result is stored, expires and is published as Celery's backend does it; a
stored success is never overwritten by a late write; a meta whose status is not its first
field is read whole to find it.  A task that takes its STARTED write along has it held for
its first round trip (workers/tasks.before_call), once, and a later state stands instead."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Iterator

import pytest
import redis
from celery import states
from celery.app.task import Context

from gateway_tasks.core.celery_app import make_app
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.result_backend import (STARTED_WITH_FIRST_TRIP, ResultBackend, ResultStoreCall, same_server,
                                               take_started)
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import load_settings


@pytest.fixture
def backend(redis_url, key_prefix):
    app = make_app(load_settings(env={}, redis_url=redis_url, key_prefix=key_prefix))
    assert isinstance(app.backend, ResultBackend)
    yield app.backend
    app.close()


def meta(r: redis.Redis, backend: ResultBackend, task_id: str) -> dict:
    return json.loads(r.get(backend.get_key_for_task(task_id)))


def test_a_result_is_stored_with_its_expiry_and_published(r, backend):
    task_id = str(uuid.uuid4())
    key = backend.get_key_for_task(task_id)
    pubsub = r.pubsub()
    pubsub.subscribe(key)
    assert pubsub.get_message(timeout=1.0)["type"] == "subscribe"
    try:
        backend.store_result(task_id, None, states.STARTED)
        backend.store_result(task_id, {"text": "hi"}, states.SUCCESS)
        got = meta(r, backend, task_id)
        assert got["status"] == states.SUCCESS and got["result"] == {"text": "hi"}
        assert got["task_id"] == task_id
        assert 0 < r.ttl(key) <= backend.expires
        published = []
        deadline = time.monotonic() + 5
        while len(published) < 2 and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.5)
            if message and message["type"] == "message":
                published.append(json.loads(message["data"])["status"])
        assert published == [states.STARTED, states.SUCCESS]
        assert backend.get_task_meta(task_id)["status"] == states.SUCCESS
    finally:
        pubsub.close()
        r.delete(key)


def test_a_stored_success_is_kept_against_a_late_write(r, backend):
    # a lost worker's rerun writing STARTED or FAILURE after the first run succeeded
    task_id = str(uuid.uuid4())
    try:
        backend.store_result(task_id, 42, states.SUCCESS)
        backend.store_result(task_id, None, states.STARTED)
        backend.store_result(task_id, ValueError("late"), states.FAILURE)
        got = meta(r, backend, task_id)
        assert got["status"] == states.SUCCESS and got["result"] == 42
    finally:
        r.delete(backend.get_key_for_task(task_id))


def test_a_failure_overwrites_started_and_takes_the_failure_expiry(r, backend):
    task_id = str(uuid.uuid4())
    key = backend.get_key_for_task(task_id)
    try:
        backend.store_result(task_id, None, states.STARTED)
        backend.store_result(task_id, ValueError("boom"), states.FAILURE)
        assert meta(r, backend, task_id)["status"] == states.FAILURE
        assert 0 < r.ttl(key) <= backend.failure_expires
    finally:
        r.delete(key)


@pytest.mark.parametrize("stored, kept", [
    ('{"result": 7, "status": "SUCCESS"}', True),       # status not first: read whole
    ('{"status":"SUCCESS","result":7}', True),         # compact separators
    ('{"result": 7, "status": "STARTED"}', False),
    ("not json", False),                                # unreadable: overwritten
])
def test_the_success_check_reads_any_meta(r, key_prefix, stored, kept):
    key = f"{key_prefix}meta"
    r.set(key, stored)
    new = '{"status": "STARTED", "result": null}'
    assert scripts_for(r).run(ResultStoreCall(key, new, 0)) is (not kept)
    assert r.get(key).decode() == (stored if kept else new)
    assert r.ttl(key) == -1                              # 0: no expiry set


# -- a task that takes its STARTED write along with its first round trip ------------------

HOLDING_TASK = "gt-test.holds-started"


@contextlib.contextmanager
def running(backend: ResultBackend, task_id: str) -> Iterator[Context]:
    """The task registered with STARTED_WITH_FIRST_TRIP running ``task_id`` in this thread, as
    Celery's tracer has it when it writes STARTED (its request pushed); yields that request."""
    if HOLDING_TASK not in backend.app.tasks:
        def holds_started() -> None:
            return None
        backend.app.task(name=HOLDING_TASK, **{STARTED_WITH_FIRST_TRIP: True})(holds_started)
    task = backend.app.tasks[HOLDING_TASK]
    request = Context(task=HOLDING_TASK, id=task_id)
    task.push_request(id=task_id, task=HOLDING_TASK)
    try:
        yield request
    finally:
        task.pop_request()


def test_a_task_that_takes_its_started_write_along_gets_it_held_once(r, backend):
    task_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    key = backend.get_key_for_task(task_id)
    try:
        with running(backend, task_id) as request:
            backend.store_result(task_id, {"pid": 1}, states.STARTED, request=request)
            assert r.get(key) is None                       # nothing written yet
            assert take_started(other) is None              # another task's: dropped
            assert take_started(task_id) is None            # ... and so was this one: once
            backend.store_result(task_id, {"pid": 1}, states.STARTED, request=request)
        held = take_started(task_id)
        assert held is not None and held.rides_with(r) and take_started(task_id) is None
        held.send()
        assert meta(r, backend, task_id)["status"] == states.STARTED
    finally:
        r.delete(key)


def test_a_later_state_of_the_task_stands_instead_of_its_held_started(r, backend):
    task_id = str(uuid.uuid4())
    try:
        with running(backend, task_id) as request:
            backend.store_result(task_id, None, states.STARTED, request=request)
            backend.store_result(task_id, ValueError("bad request"), states.FAILURE, request=request)
        assert take_started(task_id) is None
        assert meta(r, backend, task_id)["status"] == states.FAILURE
    finally:
        r.delete(backend.get_key_for_task(task_id))


def test_other_tasks_write_started_at_once(r, backend):
    task_id = str(uuid.uuid4())
    try:
        backend.store_result(task_id, None, states.STARTED, request=Context(task="some.other"))
        assert take_started(task_id) is None
        assert meta(r, backend, task_id)["status"] == states.STARTED
    finally:
        r.delete(backend.get_key_for_task(task_id))


def test_a_started_write_for_a_task_not_running_here_is_written_at_once(r, backend):
    # a tool or an API process writing a task's state: no task body of it follows in this thread
    task_id, running_id = str(uuid.uuid4()), str(uuid.uuid4())
    try:
        with running(backend, running_id) as request:
            backend.store_result(task_id, None, states.STARTED, request=Context(task=HOLDING_TASK))
            assert take_started(task_id) is None
            assert meta(r, backend, task_id)["status"] == states.STARTED
        backend.store_result(running_id, None, states.STARTED, request=request)   # popped: not running
        assert meta(r, backend, running_id)["status"] == states.STARTED
    finally:
        r.delete(backend.get_key_for_task(task_id), backend.get_key_for_task(running_id))


def test_before_call_sends_the_held_started_write_in_its_round_trip(r, backend, settings):
    from workers.pipeline import before_call
    keys, pool = Keys(settings.key_prefix), settings.pools[0]
    task_id = str(uuid.uuid4())
    r.set(keys.cancelled(task_id), "queued")
    try:
        with running(backend, task_id) as request:
            backend.store_result(task_id, None, states.STARTED, request=request)
        got = before_call(r, keys, settings, pool, task_id, started=take_started(task_id))
        assert got.cancel_mark == "queued" and got.lease_held
        assert meta(r, backend, task_id)["status"] == states.STARTED
    finally:
        r.delete(backend.get_key_for_task(task_id))


def test_a_held_started_write_for_another_server_goes_through_the_backend(r, backend, settings):
    from workers.pipeline import before_call
    keys, gateway_pool = Keys(settings.key_prefix), settings.pools[0]
    task_id = str(uuid.uuid4())
    pool = r.connection_pool                                # the task's reads: another database
    elsewhere = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, **{**pool.connection_kwargs, "db": 1}))
    try:
        with running(backend, task_id) as request:
            backend.store_result(task_id, None, states.STARTED, request=request)
        held = take_started(task_id)
        assert held is not None and not held.rides_with(elsewhere)
        assert before_call(elsewhere, keys, settings, gateway_pool, task_id, started=held).cancel_mark is None
        assert meta(r, backend, task_id)["status"] == states.STARTED
    finally:
        r.delete(backend.get_key_for_task(task_id))
        elsewhere.close()


@pytest.mark.parametrize("a, b, same", [
    (dict(host="h", port=1, db=0), dict(host="h", port=1, db=0), True),
    (dict(host="h", port=1, db=0), dict(host="h", port=2, db=0), False),
    (dict(host="h", port=1, db=0), dict(host="h", port=1, db=1), False),
    (dict(path="/tmp/r.sock", db=0), dict(path="/tmp/r.sock"), True),
])
def test_same_server(a, b, same):
    class Client:
        def __init__(self, kw):
            self.connection_pool = type("P", (), {"connection_kwargs": kw})()
    assert same_server(Client(a), Client(b)) is same
