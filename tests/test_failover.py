"""The VIP fallback channel: the circuit breaker (lua/upstream/circuit.lua), the backup bucket
(lua/bucket/take.lua), the routing choice (pure), and failover / failback end to end with two
simulator processes -- one killed, forced to 500 or to 429 -- and a real worker."""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from gateway_tasks.upstream.health import CLOSED, OPEN, PoolHealth, choose_pool, read_health
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.scripts import scripts_for
from gateway_tasks.core.settings import Circuit, Pool
from gateway_tasks.core.stats import CIRCUIT_CLOSES, CIRCUIT_OPENS, FAILOVERS
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorProcess
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.upstream.circuit import CALL, PROBE, WAIT, PoolCircuit
from gateway_tasks.bucket.calls import TakeCall

@pytest.fixture(autouse=True)
def no_keys_left(request, redis_url):
    """After the test's teardown (this fixture is set up first, so torn down last) no key
    is left under its prefix: not the worker's, not Celery's."""
    yield
    prefix = (request.node.funcargs or {}).get("key_prefix")
    if prefix:
        client = redis.Redis.from_url(redis_url)
        try:
            left = [k.decode() for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        finally:
            client.close()
        assert left == [], f"{len(left)} keys left under {prefix}: {sorted(left)[:10]}"


P = Pool("p", base_url="http://127.0.0.1:9/v1", api_key="k", models=("m",), tpm=60_000, rpm=600)
B = Pool("b", base_url="http://127.0.0.1:9/v1", api_key="k", models=("m",), tpm=60_000, rpm=600)


def test_circuit_opens_holds_the_pool_probes_and_closes(r, key_prefix):
    keys = Keys(key_prefix)
    c = PoolCircuit(r, keys, Circuit(failure_threshold=3, open_s=0.3, probe_timeout_s=5), P)
    assert c.allow().verdict == CALL
    assert [c.failure().verdict for _ in range(3)] == ["counted", "counted", "opened"]
    held = c.allow()
    assert held.verdict == WAIT and held.state == OPEN
    health = read_health(r, keys, [P])["p"]
    assert health.circuit == OPEN and health.blocked_until_ms >= held.until_ms   # pick.lua holds the pool
    assert "circuit is open" in health.unavailable(P, 10, 2_000)
    time.sleep(0.35)
    probe = c.allow()
    assert probe.verdict == PROBE
    assert c.allow().verdict == WAIT                      # one probe at a time
    assert c.failure().verdict == "opened"                # a failed probe re-opens
    time.sleep(0.35)
    assert c.allow().verdict == PROBE
    assert c.success().verdict == "closed"                # failback
    assert c.allow().verdict == CALL and c.allow().failures == 0
    stats = {k.decode(): int(v) for k, v in r.hgetall(keys.stats("p")).items()}
    assert stats[CIRCUIT_OPENS] == 2 and stats[CIRCUIT_CLOSES] == 1
    from gateway_tasks.core.settings import load_settings
    from gateway_tasks.metrics.exporter import render
    text = render(r, load_settings(env={}, key_prefix=key_prefix, pools=(P,))).decode()
    assert 'gateway_circuit_state{pool="p",state="closed"} 1.0' in text
    assert 'gateway_circuit_opens_total{pool="p"} 2.0' in text


def test_a_4xx_answer_to_the_half_open_probe_closes_the_circuit(r, key_prefix, settings, monkeypatch):
    """The upstream answered (it refused the request: the caller's error): it is reachable,
    so the probe succeeded -- the circuit closes now, not after probe_timeout_s."""
    from gateway_tasks.core.errors import UpstreamRejected
    from gateway_tasks.dispatch.request import InferenceRequest
    from workers import pipeline
    keys = Keys(key_prefix)
    c = PoolCircuit(r, keys, Circuit(failure_threshold=1, open_s=0.05, probe_timeout_s=30), P)
    assert c.failure().verdict == "opened"
    time.sleep(0.1)
    gate = c.allow()
    assert gate.verdict == PROBE
    req = InferenceRequest("t", "vip", "p", "m", [{"role": "user", "content": "x"}], 5, 1, 6)
    admitted = pipeline.Admitted(req, P, settings.tier("vip"), 0, "m", 5, c, gate, ())
    job = pipeline.Job("task-1", None, settings, keys, r, None, None)

    def refused(*_args):
        raise UpstreamRejected("the upstream refused the request (400): no", None, "", 400)
    monkeypatch.setattr(pipeline, "_upstream", refused)
    with pytest.raises(UpstreamRejected):
        pipeline.call(job, admitted)
    assert c.allow().verdict == CALL and r.hget(keys.circuit("p"), "state") in (b"closed", None)


def test_level_cancel_mark_and_closed_circuit_in_one_round_trip_of_plain_reads(settings):
    import redis

    from gateway_tasks.local.redis_server import EmbeddedRedis
    from workers.pipeline import before_call

    pool = settings.pools[0]
    keys = Keys(settings.key_prefix)
    with EmbeddedRedis() as server:          # private: its command counters are this test's own
        r = redis.Redis.from_url(server.url)
        r.hset(keys.overload_state, "level", 2)
        r.config_resetstat()
        got = before_call(r, keys, settings, pool, "t-1")
        assert (got.level, got.gate.verdict, got.cancel_mark) == (2, CALL, None)
        assert "cmdstat_evalsha" not in r.info("commandstats")   # closed: no script ran
        r.set(keys.cancelled("t-1"), "queued")
        assert before_call(r, keys, settings, pool, "t-1").cancel_mark == "queued"
        off = settings.with_(overload=settings.overload.__class__(enabled=False))
        assert before_call(r, keys, off, pool, "t-1").level == 0
        # open: the read gives no verdict; circuit.lua decides (here: wait, then the probe)
        c = PoolCircuit(r, keys, Circuit(failure_threshold=1, open_s=0.2), pool)
        c.failure()
        assert before_call(r, keys, settings, pool, "t-2").gate is None
        assert c.allow().verdict == "wait"
        r.close()


@pytest.mark.parametrize("raw, verdict", [
    ([None, None], ("closed", CALL, 0, 0)),          # never used: closed
    ([b"closed", b"0"], ("closed", CALL, 0, 0)),
    ([b"closed", b"2"], ("closed", CALL, 0, 2)),     # failures counted: a success must reset them
    ([b"open", b"3"], None),
    ([b"half_open", b"3"], None),
])
def test_closed_verdict_from_a_read_of_the_circuit(raw, verdict):
    from gateway_tasks.upstream.circuit import closed_verdict

    got = closed_verdict(raw)
    assert (got and (got.state, got.verdict, got.until_ms, got.failures)) == verdict
    if got:
        assert got.may_call and got.clean == (verdict[3] == 0)


def test_a_success_resets_the_consecutive_failures(r, key_prefix):
    c = PoolCircuit(r, Keys(key_prefix), Circuit(failure_threshold=2), P)
    c.failure()
    c.success()
    assert c.failure().verdict == "counted"


def test_take_debits_the_backup_bucket_or_says_how_long(r, key_prefix):
    keys = Keys(key_prefix)
    scripts = scripts_for(r)
    first = scripts.run(TakeCall(keys, B, 59_000))
    assert first.admitted and first.debited_tokens == 59_000 and first.dispatches == 1
    second = scripts.run(TakeCall(keys, B, 5_000))
    assert not second.admitted and 3_000 < second.wait_ms <= 4_100      # 1k/s refill, ~1k left


H = dict(now_ms=1_000)


@pytest.mark.parametrize("primary, backup, expected, why", [
    (PoolHealth("p", **H), PoolHealth("b", **H), "p", ""),
    (PoolHealth("p", circuit=OPEN, open_until_ms=3_000, **H), PoolHealth("b", **H), "b", "circuit is open"),
    (PoolHealth("p", circuit=OPEN, open_until_ms=500, **H), PoolHealth("b", **H), "p", ""),  # probe due
    (PoolHealth("p", blocked_until_ms=5_000, **H), PoolHealth("b", **H), "b", "drained by an upstream 429"),
    (PoolHealth("p", tokens=0, **H), PoolHealth("b", **H), "b", "over the tier's max wait"),
    (PoolHealth("p", tokens=0, **H), PoolHealth("b", tokens=0, **H), "p", ""),    # nowhere better: wait
    (PoolHealth("p", circuit=OPEN, open_until_ms=9_000, **H),
     PoolHealth("b", circuit=OPEN, open_until_ms=9_000, **H), "p", ""),
])
def test_choose_pool_table(primary, backup, expected, why):
    route = choose_pool(P, [B], {"p": primary, "b": backup}, est_tokens=5_000, max_wait_ms=2_000)
    assert route.pool.name == expected and why in route.reason
    assert (route.reason == "") == (expected == "p")


assert CLOSED == "closed"

# -- end to end: two simulator processes, one worker -----------------------------------


def deploy(settings, primary_url, backup_url, tmp_path, *, primary_tpm=600_000, open_s=1.0):
    primary = Pool("default", base_url=primary_url, api_key="k", models=("gpt-4o-mini",),
                   tpm=primary_tpm, rpm=6_000, timeout_s=5, backup_pools=("backup",))
    backup = Pool("backup", base_url=backup_url, api_key="k2", models=("gpt-4o-mini",),
                  tpm=600_000, rpm=6_000, timeout_s=5)
    s = settings.with_(pools=(primary, backup), circuit=Circuit(failure_threshold=3, open_s=open_s))
    gw = Gateway(s)
    gw.register_tenant("acme", "vip")
    gw.register_tenant("pro1", "normal")
    worker = processes.worker(s, concurrency=4, log_path=str(tmp_path / "worker.log")).start()
    processes.wait_for_workers(gw.app, 1)
    return gw, worker


@pytest.mark.slow
def test_killed_primary_vip_fails_over_others_wait_then_failback(settings, tmp_path):
    backup_sim = SimulatorProcess(SimConfig(base_latency_ms=5)).start()
    primary_sim = SimulatorProcess(SimConfig(base_latency_ms=5)).start()
    port = primary_sim.port
    gw, worker = deploy(settings, primary_sim.base_url, backup_sim.base_url, tmp_path)
    keys = Keys(gw.settings.key_prefix)
    try:
        assert gw.submit("acme", "warm-up", max_tokens=5).get(timeout=30)["pool"] == "default"
        primary_sim.proc.kill()                     # the primary upstream dies
        primary_sim.proc.wait()
        vip = [gw.submit("acme", f"vip {i}", max_tokens=5) for i in range(6)]
        normal = [gw.submit("pro1", f"normal {i}", max_tokens=5) for i in range(3)]
        served = [h.get(timeout=60) for h in vip]
        assert all(res["pool"] == "backup" for res in served)
        assert all(res["overload"]["pool"]["failover"] for res in served)
        at_dispatch = [res for res in served if res["overload"]["failover"]["at"] == "dispatch"]
        assert at_dispatch and "APIConnectionError" in at_dispatch[0]["overload"]["failover"]["reason"]
        # the others wait for their pool (queued, or started and put back: never done, never failed)
        assert all(h.status in ("PENDING", "STARTED") for h in normal), [h.status for h in normal]
        assert r_stat(gw, keys, "default", CIRCUIT_OPENS) >= 1
        assert r_stat(gw, keys, "default", FAILOVERS) >= 1
        # the primary comes back on the same address: the half-open probe closes the circuit
        primary_sim = SimulatorProcess(SimConfig(base_latency_ms=5), port=port).start()
        done = [h.get(timeout=60) for h in normal]
        assert all(res["pool"] == "default" and not res["overload"]["pool"]["failover"] for res in done)
        deadline = time.monotonic() + 20
        while gw.r.hget(keys.circuit("default"), "state") != b"closed" and time.monotonic() < deadline:
            time.sleep(0.1)
        back = gw.submit("acme", "after the failback", max_tokens=5).get(timeout=30)
        assert back["pool"] == "default" and not back["overload"]["changed"]     # failback
        assert r_stat(gw, keys, "default", CIRCUIT_CLOSES) >= 1
        assert backup_sim.stats()["requests_ok"] >= 6
    finally:
        worker.stop()
        primary_sim.stop()
        backup_sim.stop()
        gw.app.close()


def r_stat(gw, keys, pool, field):
    return int(gw.r.hget(keys.stats(pool), field) or 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["500", "429"])
def test_failing_primary_vip_served_by_the_backup_within_two_attempts(settings, tmp_path, mode):
    if mode == "500":
        primary_cfg, tpm = SimConfig(base_latency_ms=5, fail_rate=1.0), 600_000
    else:   # the upstream's real quota (1 RPM, used up below) is far below what the pool claims
        primary_cfg, tpm = SimConfig(base_latency_ms=5, rpm=1, burst_s=1), 600_000
    with SimulatorProcess(SimConfig(base_latency_ms=5)) as backup_sim, \
            SimulatorProcess(primary_cfg) as primary_sim:
        gw, worker = deploy(settings, primary_sim.base_url, backup_sim.base_url, tmp_path, primary_tpm=tpm)
        keys = Keys(gw.settings.key_prefix)
        try:
            if mode == "429":
                httpx.post(f"{primary_sim.base_url}/chat/completions", timeout=10,
                           json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]})
            # the first meets the failing primary at dispatch; the next ones are queued while
            # it is failing (500: circuit counting, then open) or routed at submit (429: drained)
            handles = [gw.submit("acme", "vip 0 " + "word " * 40, max_tokens=50)]
            handles[0].get(timeout=60)
            handles += [gw.submit("acme", f"vip {i} " + "word " * 40, max_tokens=50) for i in range(1, 6)]
            results = [h.get(timeout=60) for h in handles]
            attempts = [int(gw.r.get(keys.attempts(h.id)) or 0) for h in handles]
            primary_stats = primary_sim.stats()
        finally:
            worker.stop()
            gw.app.close()
    assert all(res["pool"] == "backup" for res in results)
    first = results[0]["overload"]["failover"]
    assert first["at"] == "dispatch" and first["from"] == "default" and first["to"] == "backup"
    assert ("429" in first["reason"]) if mode == "429" else ("InternalServerError" in first["reason"])
    assert all(a == 0 for a in attempts)            # no requeue: the second attempt was the backup
    if mode == "500":
        assert primary_stats["requests_error"] >= 3
        # at dispatch, or -- once the circuit opened (3 failures) -- routed there at submit
        assert all(f["at"] == "dispatch" or "circuit is open" in f["reason"]
                   for f in (res["overload"]["failover"] for res in results))
    else:
        assert primary_stats["requests_429"] >= 1 and primary_stats["requests_ok"] == 1   # the one used up
        later = [res["overload"]["failover"] for res in results[1:]]
        assert all(f["at"] == "submit" and "drained by an upstream 429" in f["reason"] for f in later)


# -- moving queued reserved-tier tasks off a blocked pool ----------------------------


def two_pools(settings, url_p="http://127.0.0.1:9/v1", url_b="http://127.0.0.1:9/v1"):
    primary = Pool("default", base_url=url_p, api_key="k", models=("gpt-4o-mini", "gpt-4o"), tpm=600_000,
                   rpm=6_000, backup_pools=("backup",))
    backup = Pool("backup", base_url=url_b, api_key="k2", models=("gpt-4o-mini",), tpm=600_000, rpm=6_000)
    return settings.with_(pools=(primary, backup))


def test_rescuer_moves_queued_vip_off_a_drained_pool_and_leaves_the_others(r, settings):
    from gateway_tasks.dispatch.broker import queued_messages
    from gateway_tasks.dispatch.index_entry import IndexEntry
    from gateway_tasks.bucket.pool_bucket import PoolBucket
    from gateway_tasks.upstream.rescue import Rescuer

    s = two_pools(settings)
    keys = Keys(s.key_prefix)
    gw = Gateway(s, client=r)
    gw.register_tenant("acme", "vip")
    gw.register_tenant("pro1", "normal")
    vip = [gw.submit("acme", f"vip {i}", model="gpt-4o", max_tokens=5) for i in range(3)]
    normal = [gw.submit("pro1", f"normal {i}", max_tokens=5) for i in range(2)]
    enq_before = sorted(IndexEntry.decode(e).enqueued_ms for e in r.zrange(keys.index("default", "vip"), 0, -1))
    rescuer = Rescuer(r, s)
    assert rescuer.tick() == 0                               # the pool is fine: nothing moves
    PoolBucket(r, keys, s.pool("default")).drain(10_000)     # as a 429 with Retry-After 10 s does
    assert rescuer.tick() == 3
    assert r.zcard(keys.index("default", "vip")) == 0 and r.zcard(keys.index("default", "normal")) == 2
    assert r.zcard(keys.index("backup", "vip")) == 3 and r.hlen(keys.moving("default")) == 0
    moved = queued_messages(r, keys, "backup", "vip")
    assert sorted(m["headers"]["id"] for m in moved) == sorted(h.id for h in vip)   # same task ids
    import base64
    import json
    body = json.loads(base64.b64decode(moved[0]["body"]))[0][0]
    assert body["pool"] == "backup" and body["model"] == "gpt-4o-mini"       # the backup lacks gpt-4o
    d = body["degradation"]
    assert d["failover_at"] == "queue" and d["failover_from"] == "default" and "drained" in d["failover"]
    assert d["requested_model"] == "gpt-4o" and d["requested_pool"] == "default"
    enq_after = sorted(IndexEntry.decode(e).enqueued_ms for e in r.zrange(keys.index("backup", "vip"), 0, -1))
    assert enq_after == enq_before                            # their place in time is kept
    assert int(r.hget(keys.stats("default"), "rescued")) == 3
    assert len(normal) == 2


def test_a_move_whose_mover_died_is_queued_again_not_lost(r, settings):
    from gateway_tasks.upstream.rescue import Rescuer, WithdrawCall

    s = two_pools(settings)
    keys = Keys(s.key_prefix)
    gw = Gateway(s, client=r)
    gw.register_tenant("acme", "vip")
    gw.submit("acme", "survive a dead mover", max_tokens=5)
    scripts = scripts_for(r)
    taken = scripts.run(WithdrawCall(keys, "default", "vip", 10))   # a mover takes it... and dies
    assert len(taken) == 1 and r.zcard(keys.index("default", "vip")) == 0
    assert scripts.run(WithdrawCall(keys, "default", "vip", 0)) == []        # not stale yet
    time.sleep(0.01)
    stale = scripts.run(WithdrawCall(keys, "default", "vip", 0, stale_ms=5))  # later: handed out again
    assert [x["tag"] for x in stale] == [taken[0]["tag"]]
    Rescuer(r, s)._place(s.pool("default"), stale[0], None, "")              # no backup now: back home
    assert r.zcard(keys.index("default", "vip")) == 1 and r.hlen(keys.moving("default")) == 0


@pytest.mark.slow
def test_vip_queued_on_a_drained_pool_is_served_by_the_backup(settings, tmp_path):
    from gateway_tasks.bucket.pool_bucket import PoolBucket

    with SimulatorProcess(SimConfig(base_latency_ms=5)) as backup_sim, \
            SimulatorProcess(SimConfig(base_latency_ms=5)) as primary_sim:
        s = two_pools(settings, primary_sim.base_url, backup_sim.base_url)
        keys = Keys(s.key_prefix)
        gw = Gateway(s)
        gw.register_tenant("acme", "vip")
        gw.register_tenant("pro1", "normal")
        vip = [gw.submit("acme", f"vip {i}", max_tokens=5) for i in range(5)]      # queued, no worker yet
        normal = gw.submit("pro1", "normal", max_tokens=5)
        PoolBucket(gw.r, keys, s.pool("default")).drain(30_000)    # then a 429 drains the primary for 30 s
        worker = processes.worker(s, concurrency=4, log_path=str(tmp_path / "worker.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            results = [h.get(timeout=30) for h in vip]
            normal_status = normal.status
            primary_ok = primary_sim.stats()["requests_ok"]
        finally:
            worker.stop()
            gw.app.close()
    assert all(res["pool"] == "backup" for res in results)
    assert all(res["overload"]["failover"]["at"] == "queue" for res in results)
    assert all(res["overload"]["failover"]["from"] == "default" for res in results)
    assert normal_status in ("PENDING", "STARTED")                # the others wait out the drain
    assert primary_ok == 0
