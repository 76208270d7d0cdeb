"""The embedded Redis Cluster: it forms, keys go where their hash tag says, Lua
runs on the node that owns the keys' slot and refuses keys of two slots; and
``slot_of`` answers as CLUSTER KEYSLOT does, so co-location can be checked
without a cluster."""

from __future__ import annotations

import os
import socket

import pytest
import redis
from redis.exceptions import ClusterCrossSlotError, RedisClusterException

from gateway_tasks.core.errors import StartupError
from gateway_tasks.local.ports import port_is_free
from devtools.redis_cluster import (BUS_PORT_OFFSET, HASH_SLOTS, EmbeddedRedisCluster,
                                    node_port, slot_of, slot_ranges)
from devtools.run_redis import delete_prefix

# the hash-tag rules: first "{", first "}" after it, something in between; else the whole key
KEYS: list[str | bytes] = [
    "", "a", "foo", "bar", "123456789", "gateway-tasks",
    "{}", "{}a", "a{}", "{a}", "{a}{b}", "a{b}c", "a{", "{a", "}{a}", "}a{", "}{", "{ }",
    "{{a}}", "{a}}", "foo{}{bar}", "foo{{bar}}zap", "foo{bar}{zap}",
    "{user1000}.following", "{user1000}.followers", "user:{1000}:queue",
    "gt:{pool-a}:queue", "gt:{pool-a}:bucket", "ключ{тег}", "é",
    b"\x00\xff{\x01}", b"\xff\xfe",
]

TAGGED_SCRIPT = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('INCR', KEYS[2])
return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}
"""


# -- without a cluster ----------------------------------------------------------
def test_slot_of_is_crc16_xmodem_of_the_hash_tag():
    assert slot_of("123456789") == 0x31C3  # the CRC16-XMODEM check value, below 16384
    assert slot_of("{user1000}.following") == slot_of("{user1000}.followers") == slot_of("user1000")
    assert slot_of("foo{}{bar}") != slot_of("bar")  # empty first tag: the whole key is hashed
    assert slot_of("foo{{bar}}zap") == slot_of("{bar")
    assert slot_of("foo{bar}{zap}") == slot_of("bar")
    assert slot_of("ключ{тег}") == slot_of("тег".encode()) and slot_of(b"a") == slot_of("a")
    assert all(0 <= slot_of(key) < HASH_SLOTS for key in KEYS)


@pytest.mark.parametrize("nodes", [1, 2, 3, 5, 7])
def test_slot_ranges_cover_every_slot_once_evenly(nodes):
    ranges = slot_ranges(nodes)
    assert [s for r in ranges for s in r] == list(range(HASH_SLOTS))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_node_port_leaves_room_for_the_cluster_bus():
    port = node_port(taken=set())
    assert port + BUS_PORT_OFFSET < 65536
    assert port_is_free(port) and port_is_free(port + BUS_PORT_OFFSET)


def test_a_node_that_exits_at_start_is_a_startup_error_and_nothing_stays():
    cluster = EmbeddedRedisCluster(nodes=3, binary="/bin/false")
    with pytest.raises(StartupError, match=r"redis-server on port \d+ exited at start"):
        cluster.start(timeout_s=5.0)
    assert all(server.process.poll() is not None for server in cluster.servers)
    assert not os.path.exists(cluster.workdir)


def test_a_cluster_not_formed_in_time_names_what_is_missing_and_is_stopped():
    cluster = EmbeddedRedisCluster(nodes=3)
    with pytest.raises(StartupError, match=r"not formed within 0.5s: node \d+: cluster_state:fail"):
        cluster.start(timeout_s=0.5)  # Redis holds a new master at fail for its first 2 s
    assert len(cluster.servers) == 3
    assert all(server.process.poll() is not None for server in cluster.servers)
    assert not os.path.exists(cluster.workdir)
    for port in cluster.ports:
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


# -- on the live cluster ---------------------------------------------------------
@pytest.fixture
def rc(redis_cluster, key_prefix):
    client = redis_cluster.client()
    yield client
    delete_prefix(client, key_prefix)
    client.close()


def owner_port(cluster: EmbeddedRedisCluster, slot: int) -> int:
    """The port of the master that owns ``slot``, as the cluster's first node sees it."""
    with cluster.node_client(cluster.ports[0]) as node:
        for start, end, master, *_replicas in node.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(master[1])
    raise AssertionError(f"no node owns slot {slot}")


def ports_holding(cluster: EmbeddedRedisCluster, pattern: str) -> dict[int, set[str]]:
    """Keys matching ``pattern`` stored on each node (asked node by node, no redirects)."""
    held = {}
    for port in cluster.ports:
        with cluster.node_client(port) as node:
            keys = set(node.scan_iter(match=pattern))
        if keys:
            held[port] = keys
    return held


def test_the_cluster_has_three_masters_covering_every_slot(redis_cluster):
    assert len(redis_cluster.ports) == 3 and redis_cluster.url == f"redis://127.0.0.1:{redis_cluster.ports[0]}"
    for port in redis_cluster.ports:
        with redis_cluster.node_client(port) as node:
            info, nodes = node.cluster("INFO"), node.cluster("NODES")
        assert info["cluster_state"] == "ok"
        assert [int(info[f"cluster_{name}"]) for name in ("size", "known_nodes", "slots_assigned", "slots_ok")] == [
            3, 3, HASH_SLOTS, HASH_SLOTS]
        assert sorted(int(a.split(":")[1].split("@")[0]) for a in nodes) == sorted(redis_cluster.ports)
        assert all("master" in n["flags"] and n["master_id"] == "-" for n in nodes.values())
        slots = [s for n in nodes.values() for lo, *hi in n["slots"] for s in range(int(lo), int((hi or [lo])[0]) + 1)]
        assert sorted(slots) == list(range(HASH_SLOTS))  # every slot, each once
    assert {owner_port(redis_cluster, r.start) for r in slot_ranges(3)} == set(redis_cluster.ports)


def test_slot_of_answers_as_cluster_keyslot(redis_cluster):
    with redis_cluster.node_client(redis_cluster.ports[0]) as node:
        live = [node.cluster("KEYSLOT", key) for key in KEYS]
    assert [slot_of(key) for key in KEYS] == live


def test_a_key_set_through_the_cluster_client_is_readable(redis_cluster, rc, key_prefix):
    keys = [f"{key_prefix}plain-{i}" for i in range(20)]
    for i, key in enumerate(keys):
        rc.set(key, i)
    with redis.RedisCluster.from_url(redis_cluster.url, socket_timeout=5.0) as other:
        assert [int(other.get(key)) for key in keys] == list(range(20))
    assert len(ports_holding(redis_cluster, f"{key_prefix}*")) == 3  # 20 untagged keys: every node
    assert delete_prefix(rc, key_prefix) == 20 and not ports_holding(redis_cluster, f"{key_prefix}*")


def test_keys_with_one_tag_share_a_node_and_tags_spread_over_the_nodes(redis_cluster, rc, key_prefix):
    tags = [f"pool-{i}" for i in range(12)]
    for tag in tags:
        for part in ("queue", "bucket", "stats"):
            rc.set(f"{key_prefix}{{{tag}}}:{part}", 1)
    nodes_of_tag = {}
    for tag in tags:
        held = ports_holding(redis_cluster, f"{key_prefix}{{{tag}}}:*")
        assert [len(keys) for keys in held.values()] == [3], f"{tag}: {held}"
        (nodes_of_tag[tag],) = held
        assert nodes_of_tag[tag] == owner_port(redis_cluster, slot_of(tag))
    assert set(nodes_of_tag.values()) == set(redis_cluster.ports)


def test_a_script_on_keys_of_one_tag_runs_on_the_node_owning_the_slot(redis_cluster, rc, key_prefix):
    keys = [f"{key_prefix}{{pool-a}}:last", f"{key_prefix}{{pool-a}}:count"]
    assert rc.eval(TAGGED_SCRIPT, 2, *keys, "v1") == [b"v1", b"1"]
    assert rc.eval(TAGGED_SCRIPT, 2, *keys, "v2") == [b"v2", b"2"]
    owner = owner_port(redis_cluster, slot_of("pool-a"))
    assert ports_holding(redis_cluster, f"{key_prefix}*") == {owner: set(keys)}
    with redis_cluster.node_client(owner) as node:
        assert node.mget(keys) == ["v2", "2"]  # no MOVED: the keys live there


def test_a_script_on_keys_of_two_slots_fails_with_crossslot(redis_cluster, rc, key_prefix):
    slot_a = slot_of("pool-a")
    # a second tag in another slot of the same node: one node is not enough, one slot is
    tag_b = next(f"pool-b{i}" for i in range(10_000) if slot_of(f"pool-b{i}") != slot_a
                 and owner_port(redis_cluster, slot_of(f"pool-b{i}")) == owner_port(redis_cluster, slot_a))
    keys = [f"{key_prefix}{{pool-a}}:last", f"{key_prefix}{{{tag_b}}}:count"]
    with pytest.raises(RedisClusterException, match="same key slot"):
        rc.eval(TAGGED_SCRIPT, 2, *keys, "v")  # redis-py refuses before sending
    # sent anyway, the server answers CROSSSLOT (redis-py raises that as ClusterCrossSlotError)
    with pytest.raises(ClusterCrossSlotError) as through_cluster_client:
        rc.execute_command("EVAL", TAGGED_SCRIPT, 2, *keys, "v", target_nodes=rc.get_node_from_key(keys[0]))
    with redis_cluster.node_client(owner_port(redis_cluster, slot_a)) as node:
        with pytest.raises(ClusterCrossSlotError) as on_the_node:
            node.eval(TAGGED_SCRIPT, 2, *keys, "v")
    assert through_cluster_client.value.status_code == on_the_node.value.status_code == "CROSSSLOT"
    assert not ports_holding(redis_cluster, f"{key_prefix}*")


def test_dispatch_runs_on_a_real_cluster_one_pool_per_shard(redis_cluster, key_prefix):
    """enqueue -> pick -> release for two pools whose hash tags live on different shards:
    no script call crosses a slot (Redis would refuse it with CROSSSLOT)."""
    import json

    from gateway_tasks.lifecycle.cancel import read_refs
    from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
    from gateway_tasks.core.keys import Keys
    from gateway_tasks.core.scripts import scripts_for
    from gateway_tasks.core.settings import Pool, Settings
    from gateway_tasks.dispatch.release import ReleaseCall
    from gateway_tasks.dispatch.router import PickPlan, Picked

    client = redis_cluster.client()
    keys = Keys(key_prefix)
    owners = {}
    for i in range(200):                       # two pool names owned by different masters
        name = f"pool{i}"
        node = client.get_node_from_key(keys.pool_tag(name))
        owners.setdefault(node.name, name)
        if len(owners) == 2:
            break
    names = list(owners.values())
    pools = tuple(Pool(n, base_url="http://127.0.0.1:1/v1", api_key="x", models=(f"m{n}",),
                       tpm=10**9, rpm=10**9) for n in names)
    s = Settings(key_prefix=key_prefix, pools=pools)
    scripts = scripts_for(client)
    try:
        for pool in names:
            for i in range(3):
                msg = {"body": "", "headers": {"gt_est_tokens": 10, "gt_tenant": f"t{i}"},
                       "properties": {"delivery_tag": f"{pool}-{i}"}}
                assert enqueue(client, EnqueueCall(keys, s.tier("vip"), pool, f"t{i}", f"{pool}-{i}", 10,
                                               json.dumps(msg), task_id=f"id-{pool}-{i}",
                                               ref_ttl_s=60)).accepted
        # each task's ref is written by the enqueue, in its pool's slot, and found by id alone
        refs = read_refs(client, keys, names, [f"id-{pool}-{i}" for pool in names for i in range(3)])
        assert {(r.pool, r.tag) for r in refs.values()} == {(p, f"{p}-{i}") for p in names for i in range(3)}
        for pool in names:
            plan = PickPlan(s, [s.queue_name(t.name, pool) for t in s.tiers])
            got = [scripts.run(plan) for _ in range(3)]
            assert all(isinstance(g, Picked) and g.pool == pool for g in got)
            assert sorted(g.tenant for g in got) == ["t0", "t1", "t2"]
            for g in got:
                assert scripts.run(ReleaseCall(keys, s, pool, g.tag)).released
            assert client.hlen(keys.dispatched(pool)) == 0 and client.hlen(keys.messages(pool)) == 0
    finally:
        delete_prefix(client, key_prefix)
