"""The gateway's command packer (gateway_tasks/core/packer.py): the same bytes as
redis-py's own packer for every argument type, redis-py's errors for what it refuses,
and the connections the gateway makes use it."""

from __future__ import annotations

import pytest
import redis
from redis.connection import Connection

from gateway_tasks.core.celery_app import make_app
from gateway_tasks.core.packer import FAST_PACKER, connection_kwargs
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.dispatch.router import PickPlan

BIG = "x" * 20_000          # over redis-py's buffer cutoff: it sends such an argument on its own


def redis_py_bytes(*args) -> bytes:
    return b"".join(bytes(part) for part in Connection()._command_packer.pack(*args))


@pytest.mark.parametrize("args", [
    ("GET", "k"),
    ("SCRIPT EXISTS", "a" * 40, "b" * 40),        # a subcommand in the name: split, as redis-py does
    (b"CLIENT SETNAME", b"me"),
    ("SET", "k", "héllo wörld"),
    ("SET", b"k", b"\xff\x00\r\n"),
    ("ZADD", "z", 0, "m", -1, 2 ** 70),
    ("HSET", "h", "f", 0.1, "g", 1e-9, "i", 1.5e20, "j", -0.0, "k", 1 / 3),
    ("SET", "k", BIG),
    ("SET", "k", memoryview(b"abc")),             # hiredis refuses it: redis-py's packer, as before
    ("SET", "k", bytearray(b"abc")),
])
def test_the_same_bytes_as_redis_py(args):
    assert b"".join(bytes(p) for p in FAST_PACKER.pack(*args)) == redis_py_bytes(*args)


def test_a_pick_call_packs_the_same():
    from gateway_tasks.core.settings import load_settings
    settings = load_settings(env={})
    plan = PickPlan(settings, settings.queue_names())
    args = ("EVALSHA", "f" * 40, len(plan.script_keys), *plan.script_keys, *plan.script_args)
    assert FAST_PACKER.pack(*args) == [redis_py_bytes(*args)]


@pytest.mark.parametrize("bad", [True, None, [1], {"a": 1}])
def test_what_redis_py_refuses_it_refuses_the_same_way(bad):
    with pytest.raises(redis.exceptions.DataError):
        Connection()._command_packer.pack("SET", "k", bad)
    with pytest.raises(redis.exceptions.DataError):
        FAST_PACKER.pack("SET", "k", bad)


def test_gateway_connections_use_it_end_to_end(r, redis_url, settings):
    client = redis.Redis.from_url(redis_url, **connection_kwargs())
    key = f"{settings.key_prefix}packer"
    client.hset(key, mapping={"s": "héllo", "n": 7, "f": 0.25})
    assert r.hgetall(key) == {b"s": "héllo".encode(), b"n": b"7", b"f": b"0.25"}
    assert client.eval("return redis.call('HGET', KEYS[1], ARGV[1])", 1, key, "n") == b"7"
    client.close()
    # the broker channel's pool (dispatch, enqueue) and the producer's own client
    app = make_app(settings)
    gw = Gateway(settings)
    try:
        with app.connection_for_write() as conn:
            assert conn.default_channel.pool.connection_kwargs["command_packer"] is FAST_PACKER
        assert gw.r.connection_pool.connection_kwargs["command_packer"] is FAST_PACKER
        gw.register_tenant("acme", "vip")
        handle = gw.submit("acme", "packed", max_tokens=5)
        assert handle.queue and scripts_for(gw.r).sha("dispatch/enqueue")
    finally:
        gw.app.close()
        app.close()
