"""The result backend's one-round-trip write (lua/result_store.lua via ResultBackend), on a
real Redis: a result is stored, expires and is published as Celery's backend does it; a
stored success is never overwritten by a late write; a meta whose status is not its first
field is read whole to find it."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from celery import states

from gateway_tasks.core.celery_app import make_app
from gateway_tasks.core.result_backend import ResultBackend, ResultStoreCall
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
