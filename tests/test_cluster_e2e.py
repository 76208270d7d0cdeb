"""A deployment on a real Redis Cluster, through the public interfaces.

First the configuration alone: a cluster URL (``redis+cluster://``, ``rediss+cluster://``)
is a first-class REDIS_URL, it needs a control Redis for Celery's machinery, and neither
shows a credential.  Then end to end on the 3-master cluster the test fixtures start (``redis_cluster``)
with the test Redis (6379) as the control Redis: two pools whose hash tags live on
different masters, one real Celery worker per pool, the simulator upstream, tenants
registered by the CLI and the Python API, tasks submitted over REST and Python, results
read, a cron fired by the beat engine, cancel and dependencies across pools, and a master
restarted mid-run (SIGTERM: its append-only file written out) with nothing lost.  The other
processes run as the manual starts them: beat firing a cron, `gateway api`, `gateway flower`
(its pages free of secrets), `gateway metrics` and the operator commands, and `make demo`.

The module starts its own servers: it does not run again under GATEWAY_TEST_REDIS=embedded.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from kombu import Queue

from beat.engine import CronEngine
from beat.fire import gateway_fire
from beat.store import CronStore, now_ms
from devtools import processes
from devtools.api_thread import ApiThread
from devtools.redis_cluster import slot_of
from devtools.run_redis import delete_prefix
from gateway_tasks.cli import flower as flower_cli
from gateway_tasks.core.celery_app import make_app
from gateway_tasks.core.errors import ConfigError, RedisFull, RedisUnavailable, TaskCancelled
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.redis_client import connect, node_options, server_client
from gateway_tasks.core.result_backend import ClusterResults
from gateway_tasks.core.settings import Pool, Settings, load_settings, settings_to_json
from gateway_tasks.core.urls import cluster_nodes, without_credentials
from gateway_tasks.dispatch.dead_letters import dead_letters
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.local.ports import free_port
from gateway_tasks.metrics.exporter import render
from gateway_tasks.producer.cancel import WAITING
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.producer.memory_guard import MIB, MemoryGuard
from gateway_tasks.rest.result_waiter import ResultWaiter
from gateway_tasks.simulator import SimConfig, SimulatorThread
from workers.app import make_worker_app
from workers.startup import check_queues

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("GATEWAY_TEST_REDIS") == "embedded",
                                 reason="starts its own Redis Cluster: run once, not again on the embedded Redis")]

SECRET = "s3cr3t-Pa55word"
POOL_KEY = "sk-cluster-e2e-0123456789SECRET"      # the pools' upstream key: never served, never printed
ADMIN_KEY = "admin-cluster-e2e-SECRET"
SECRETS = (POOL_KEY, ADMIN_KEY, "SECRET")             # what no process serves or prints
CONTROL = "redis://127.0.0.1:6379/0"
HELLO = [{"role": "user", "content": "Say hello"}]


# -- the configuration, without servers ---------------------------------------------------

def cluster_settings(**env: str) -> Settings:
    return load_settings(env={"REDIS_URL": "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
                              "GATEWAY_CONTROL_REDIS_URL": CONTROL, **env})


def test_a_cluster_url_with_a_control_redis_is_a_deployment():
    s = cluster_settings()
    assert s.redis_cluster and s.broker_url == CONTROL
    assert cluster_nodes(s.redis_url) == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    app = make_app(s)
    assert app.conf.broker_url == CONTROL                      # Celery's machinery: the control Redis
    assert app.conf.result_backend.endswith("+redis+cluster://10.0.0.1:7000,10.0.0.2:7001")   # results: the cluster
    standalone = load_settings(env={"REDIS_URL": CONTROL})
    assert not standalone.redis_cluster and standalone.broker_url == CONTROL and make_app(standalone).conf.broker_url == CONTROL


@pytest.mark.parametrize("env, message", [
    ({"GATEWAY_CONTROL_REDIS_URL": ""}, r"is a Redis Cluster, .* set control_redis_url \(GATEWAY_CONTROL_REDIS_URL\)"),
    ({"REDIS_URL": "redis+cluster://h1:7000,h2:port"}, r"'h2:port' is not host:port"),
    ({"REDIS_URL": "redis+cluster://h1:7000/3"}, r"a Redis Cluster has only database 0"),
    ({"GATEWAY_CONTROL_REDIS_URL": "redis+cluster://c1:7000"}, r"control_redis_url=.* expected one standalone Redis"),
    ({"REDIS_URL": "rediss+cluster://h1:7000", "REDIS_TLS_CA_FILE": "/ca.pem"},
     r"control_redis_url is not rediss://"),
    ({"REDIS_URL": "redis+cluster://h1:7000", "REDIS_TLS_CA_FILE": "/ca.pem"}, r"redis_url is not rediss://"),
])
def test_a_cluster_url_that_cannot_work_is_a_config_error_naming_the_fix(env, message):
    with pytest.raises(ConfigError, match=message):
        cluster_settings(**env)


def test_a_cluster_urls_credentials_reach_every_node_and_are_never_shown():
    s = load_settings(env={"REDIS_URL": "rediss+cluster://10.0.0.1:7000,[::1]:7001",
                           "GATEWAY_CONTROL_REDIS_URL": "rediss://10.0.0.9:6379/0",
                           "REDIS_USERNAME": "gateway", "REDIS_PASSWORD": SECRET, "REDIS_TLS_CA_FILE": "/ca.pem"})
    options = node_options(s.redis_url)
    assert (options["username"], options["password"], options["ssl_ca_certs"]) == ("gateway", SECRET, "/ca.pem")
    assert options["connection_class"].__name__ == "SSLConnection"     # TLS on every node
    node = server_client(s.redis_url, ("::1", 7001)).connection_pool.connection_kwargs   # not connected
    assert (node["host"], node["port"], node["password"], node["ssl_ca_certs"]) == ("::1", 7001, SECRET, "/ca.pem")
    assert SECRET in s.control_redis_url and "gateway:" in s.control_redis_url
    public = s.public()
    shown = [without_credentials(s.redis_url), public.redis_url, public.control_redis_url, settings_to_json(public),
             make_app(s).conf.broker_transport_options["gateway_public_settings"]]
    assert not any(SECRET in text for text in shown)
    with pytest.raises(ConfigError) as refused:
        load_settings(env={"REDIS_URL": f"redis+cluster://gateway:{SECRET}@h1:7000/2", "GATEWAY_CONTROL_REDIS_URL": CONTROL})
    assert SECRET not in str(refused.value)


def test_on_a_cluster_a_worker_serves_one_pools_queues():
    pools = tuple(Pool(n, base_url="http://127.0.0.1:1/v1", api_key="k", models=(f"m-{n}",), tpm=1000, rpm=10)
                  for n in ("alpha", "beta"))
    s = cluster_settings().with_(pools=pools)
    alpha = [s.queue_name(t.name, "alpha") for t in s.tiers]
    check_queues(s, alpha)
    with pytest.raises(ConfigError, match=r"one worker per pool, e.g. -Q gt\.vip\.alpha,gt\.normal\.alpha,gt\.batch\.alpha"):
        check_queues(s, [*alpha, s.queue_name("vip", "beta")])
    check_queues(s.with_(redis_url=CONTROL, control_redis_url=""), [*alpha, s.queue_name("vip", "beta")])


# -- the clients on the cluster, without workers ---------------------------------------------

@pytest.fixture
def cluster_url(redis_cluster, key_prefix):
    """The test cluster's URL (two of its masters as seeds); the test's keys go at teardown."""
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports[:2])
    yield url
    with connect(url) as rc:
        delete_prefix(rc, key_prefix)


def test_an_enqueue_after_its_slot_moved_goes_to_the_new_owner(cluster_url, key_prefix, settings):
    """A stale slot map (as after a failover): the master asked answers MOVED, the map is
    refreshed and the enqueue sent to the owner, once."""
    client = connect(cluster_url)
    keys = Keys(key_prefix)
    slot = client.keyslot(keys.pool_tag("default"))
    owner = client.nodes_manager.slots_cache[slot][0]
    client.nodes_manager.slots_cache[slot] = [next(n for n in client.get_primaries() if n != owner)]
    message = {"body": "", "headers": {"gt_est_tokens": 10, "gt_tenant": "acme"}, "properties": {"delivery_tag": "t1"}}
    done = enqueue(client, EnqueueCall(keys, settings.tier("vip"), "default", "acme", "t1", 10, json.dumps(message)))
    assert done.accepted and client.nodes_manager.slots_cache[slot][0] == owner
    assert client.zcard(keys.index("default", "vip")) == 1 and client.hlen(keys.messages("default")) == 1


def test_results_are_stored_on_the_cluster_and_waited_for_by_celery_and_the_rest_waiter(cluster_url, key_prefix,
                                                                                         redis_url):
    """A result written while a reader waits: Celery's result consumer (a pub/sub connection to
    one master) and the REST waiter (an asyncio cluster client) both wake with it, whichever
    master its key lives on."""
    s = load_settings(env={}, redis_url=cluster_url, control_redis_url=redis_url, key_prefix=key_prefix)
    app = make_app(s)
    backend = app.backend
    ids = [f"r{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    assert len({slot_of(backend.get_key_for_task(i)) for i in ids}) > 1      # keys of several slots

    def store_soon(task_id: str) -> None:
        time.sleep(0.3)
        backend.store_result(task_id, {"answer": task_id}, "SUCCESS")

    with ThreadPoolExecutor(2) as bg:
        bg.submit(store_soon, ids[0])
        assert app.AsyncResult(ids[0]).get(timeout=10) == {"answer": ids[0]}
        waiter = ResultWaiter.for_backend(backend, s.redis_url)

        async def wait_for(task_id: str):
            try:
                return await waiter.wait(task_id, 10)
            finally:
                await waiter.close()

        bg.submit(store_soon, ids[1])
        meta = asyncio.run(wait_for(ids[1]))
    assert meta["status"] == "SUCCESS" and meta["result"] == {"answer": ids[1]}
    for task_id in ids[2:]:
        backend.store_result(task_id, task_id, "SUCCESS")
    assert backend.client.mget([backend.get_key_for_task(i) for i in ids])[5] is not None   # several slots
    assert [app.AsyncResult(i).get(timeout=5) for i in ids[2:]] == ids[2:]
    app.close()


def test_a_dispatcher_picks_on_its_pools_master_and_waits_out_a_cluster_that_refuses(redis_cluster, cluster_url,
                                                                                     key_prefix, redis_url, caplog):
    """The worker transport's event loop on a cluster: a message published through the
    producer transport is enqueued on the pool's master and picked there over the poll
    connection; while that master refuses (CLUSTERDOWN: a slot of its own unassigned, the
    cluster not fully covered) the dispatcher pauses and polls again, and picks once the
    cluster is whole."""
    s = load_settings(env={}, redis_url=cluster_url, control_redis_url=redis_url, key_prefix=key_prefix)
    queue = s.queue_name("vip", "default")
    producer, worker = make_app(s), make_worker_app(s)
    got: list = []

    def publish(n: int) -> None:
        with producer.connection_for_write() as conn:
            conn.Producer(serializer="json").publish(   # a Celery message, as Gateway.submit's
                [[n], {}, {}], routing_key=queue,
                headers={"gt_est_tokens": 10, "gt_tenant": "acme", "task": "gateway.noop", "id": uuid.uuid4().hex})

    master = owner(redis_cluster, Keys(key_prefix).pool_tag("default"))
    with redis_cluster.node_client(master) as node:
        free = next(slot for start, end, m, *_ in node.execute_command("CLUSTER SLOTS") if int(m[1]) == master
                    for slot in range(start, end + 1) if node.cluster("COUNTKEYSINSLOT", slot) == 0
                    and slot != slot_of(Keys(key_prefix).pool_tag("default")))
        with worker.connection_for_read() as conn, conn.Consumer(
                [Queue(queue, no_declare=True)], accept=["json"], callbacks=[lambda body, m: (got.append(body), m.ack())]):
            publish(1)
            conn.drain_events(timeout=5)
            publish(2)
            node.cluster("DELSLOTS", free)
            try:
                with pytest.raises(TimeoutError), caplog.at_level("WARNING"):
                    conn.drain_events(timeout=1.0)          # refused: no pick, no error
            finally:
                node.cluster("ADDSLOTS", free)
                redis_cluster.wait_until_ok()
            conn.drain_events(timeout=5)
    assert [args for args, _, _ in got] == [[1], [2]]
    assert any("ClusterDownError" in r.getMessage() and "pausing" in r.getMessage() for r in caplog.records)
    producer.close()
    worker.close()


def test_submits_stop_when_one_master_is_near_its_maxmemory(redis_cluster, cluster_url):
    """The producer's memory guard goes by the master with the least head-room."""
    client = connect(cluster_url)
    assert MemoryGuard(client, 0.9).check() is None
    fullest = redis_cluster.ports[2]                # not a seed of the URL: found through the cluster
    with redis_cluster.node_client(fullest) as node:
        node.config_set("maxmemory", int(node.info("memory")["used_memory"]) + 1_000_000)
        try:
            with pytest.raises(RedisFull, match="maxmemory"):    # less than the 4 MiB reserve left there
                MemoryGuard(client, 0.9, reserve_bytes=4 * MIB).check()
        finally:
            node.config_set("maxmemory", 0)


# -- end to end on the cluster -----------------------------------------------------------------

def owner(cluster, key: str) -> int:
    """The port of the master owning ``key``'s slot."""
    with cluster.node_client(cluster.ports[0]) as node:
        for start, end, master, *_ in node.execute_command("CLUSTER SLOTS"):
            if start <= slot_of(key) <= end:
                return int(master[1])
    raise AssertionError(f"no master owns {key}")


def two_pools_on_two_masters(cluster, keys: Keys) -> list[str]:
    names: dict[int, str] = {}
    for i in range(500):
        names.setdefault(owner(cluster, keys.pool_tag(f"pool{i}")), f"pool{i}")
        if len(names) == 2:
            return list(names.values())
    raise AssertionError("no two pool names on two masters")


class Deployment:
    def __init__(self, cluster, settings: Settings, pools: list[str], gw: Gateway, sim, api: ApiThread):
        self.cluster, self.settings, self.pools, self.gw, self.sim, self.api = cluster, settings, pools, gw, sim, api
        self.keys = Keys(settings.key_prefix)
        self.models = {pools[0]: "gpt-4o-mini", pools[1]: "gpt-4o"}

    def tenant(self, tier: str = "vip") -> tuple[str, str]:
        name = f"t{uuid.uuid4().hex[:8]}"
        return name, self.gw.register_tenant(name, tier)

    def master_of(self, pool: str) -> int:
        return owner(self.cluster, self.keys.pool_tag(pool))

    def env(self) -> dict[str, str]:
        """A child process's environment: the deployment's settings, its cluster REDIS_URL."""
        return processes.child_env(self.settings)


@pytest.fixture(scope="module")
def deployment(redis_cluster, redis_url, module_key_prefix, tmp_path_factory):
    """Two pools on two masters, a worker for each, the REST API on real HTTP, the control Redis
    at the test Redis under the module's prefix."""
    logs = tmp_path_factory.mktemp("cluster-e2e")
    cluster_url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports[:2])
    keys = Keys(module_key_prefix)
    names = two_pools_on_two_masters(redis_cluster, keys)
    with SimulatorThread(SimConfig(base_latency_ms=10, ms_per_output_token=2.0)) as sim:
        pools = tuple(Pool(n, base_url=sim.base_url, api_key=POOL_KEY, models=(m,), tpm=600_000, rpm=6_000)
                      for n, m in zip(names, ("gpt-4o-mini", "gpt-4o")))
        s = load_settings(env={}, redis_url=cluster_url, control_redis_url=redis_url, key_prefix=module_key_prefix,
                          pools=pools, result_ttl_s=600, admin_key=ADMIN_KEY)
        gw = Gateway(s)
        workers = [processes.worker(s, queues=[s.queue_name(t.name, n) for t in s.tiers], concurrency=4,
                                    name=f"cl-{n}", log_path=str(logs / f"worker-{n}.log")).start() for n in names]
        try:
            processes.wait_for_workers(gw.app, 2, timeout_s=60)
            with ApiThread(gw) as api:
                yield Deployment(redis_cluster, s, names, gw, sim, api)
        finally:
            for w in workers:
                w.stop()
            gw.app.close()
            with connect(cluster_url) as rc:
                delete_prefix(rc, module_key_prefix)


def acked(d: Deployment, pool: str, timeout_s: float = 15.0) -> bool:
    """Whether every task dispatched on ``pool`` is released (acked after its result is stored:
    waited for, up to ``timeout_s``) and no tenant is counted in flight there."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = (d.gw.r.hlen(d.keys.dispatched(pool)) == 0
                and all(int(v) == 0 for v in d.gw.r.hvals(d.keys.inflight(pool))))
        if done or time.monotonic() > deadline:
            return done
        time.sleep(0.05)


def keys_on(cluster, pattern: str) -> dict[int, set[bytes]]:
    held = {}
    for port in cluster.ports:
        with redis.Redis(port=port) as node:
            found = set(node.scan_iter(match=pattern, count=1000))
        if found:
            held[port] = found
    return held


def test_each_pool_lives_on_its_master_and_celery_on_the_control_redis(deployment, redis_url):
    d = deployment
    a, b = d.pools
    assert d.master_of(a) != d.master_of(b)
    assert isinstance(d.gw.r, redis.RedisCluster) and isinstance(d.gw.app.backend.client, ClusterResults)
    with redis.Redis.from_url(redis_url) as control:
        on_control = {k.decode() for k in control.scan_iter(match=f"{d.settings.key_prefix}*", count=1000)}
    assert on_control and all("_kombu.binding" in k or "pidbox" in k for k in on_control), on_control
    assert not keys_on(d.cluster, f"*{d.settings.key_prefix}_kombu*")


def test_python_submits_to_two_pools_on_two_masters_and_results_come_back(deployment):
    d = deployment
    tenant, _ = d.tenant("vip")
    handles = [d.gw.submit(tenant, f"question {i}", model=d.models[p], max_tokens=8) for p in d.pools for i in range(3)]
    results = [h.get(timeout=30) for h in handles]
    assert [r["tenant_id"] for r in results] == [tenant] * 6
    assert all(r["response"]["choices"][0]["message"]["role"] == "assistant" for r in results)
    assert [r["response"]["model"] for r in results] == [d.models[p] for p in d.pools for _ in range(3)]
    for pool in d.pools:   # each pool's keys on its own master, nothing left dispatched
        held = keys_on(d.cluster, f"{d.keys.pool_tag(pool)}*")
        assert list(held) == [d.master_of(pool)]
        assert acked(d, pool)
    results_held = keys_on(d.cluster, f"{d.settings.key_prefix}celery-task-meta-*")
    assert len(results_held) >= 2                      # results spread over the masters by their own slots
    metrics = render(d.gw.r, d.settings).decode()          # the exporter reads the cluster
    assert all(f'gateway_completed_tasks_total{{pool="{p}",tier="vip"}} 3.0' in metrics for p in d.pools), metrics


def test_rest_submits_wait_and_stream_on_the_cluster(deployment):
    d = deployment
    _, key = d.tenant("normal")
    headers = {"Authorization": f"Bearer {key}"}
    for pool in d.pools:
        reply = httpx.post(f"{d.api.base_url}/chat/completions", headers=headers, timeout=30,
                           json={"model": d.models[pool], "messages": HELLO, "max_tokens": 8})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == d.models[pool] and reply.json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{d.api.base_url}/chat/completions", headers=headers, timeout=30,
                      json={"model": d.models[d.pools[1]], "messages": HELLO, "max_tokens": 12, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3


def test_the_cli_registers_a_tenant_and_shows_the_status_on_the_cluster(deployment):
    d = deployment
    name = f"cli{uuid.uuid4().hex[:6]}"
    added = subprocess.run(processes.gateway_argv("tenant", "add", name, "--tier", "batch"), env=d.env(),
                           capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr
    assert d.gw.tenants.get(name).tier == "batch"
    status = subprocess.run(processes.gateway_argv("status", "--json"), env=d.env(), capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0, status.stderr
    assert SECRET not in status.stdout


def test_a_cron_fired_by_the_beat_engine_runs_on_the_cluster(deployment):
    d = deployment
    tenant, _ = d.tenant("vip")
    store = CronStore(d.gw.r, d.settings, d.gw)
    entry = store.add(tenant, "digest", "* * * * *", {"messages": HELLO, "model": d.models[d.pools[1]],
                                                      "max_tokens": 8})
    engine = CronEngine(d.gw.r, d.settings, gateway_fire(d.settings, app=d.gw.app, client=d.gw.r))
    report = engine.tick(now_ms=entry.next_fire_ms)
    assert report.fired_count == 1
    fired = store.get(tenant, "digest")
    assert d.gw.result(fired.last_task_id).get(timeout=30)["tenant_id"] == tenant


def test_cancel_and_dependencies_across_pools(deployment):
    d = deployment
    a, b = d.pools
    tenant, _ = d.tenant("vip")
    parent = d.gw.submit(tenant, "a long answer", model=d.models[a], max_tokens=1500)   # ~1.8 s upstream
    child = d.gw.submit(tenant, "after it", model=d.models[b], max_tokens=8, depends_on=[parent.id])
    dropped = d.gw.submit(tenant, "never", model=d.models[b], max_tokens=8, depends_on=[parent.id])
    assert d.gw.cancel(dropped.id).was == WAITING
    assert child.get(timeout=30)["response"]["model"] == d.models[b]
    assert parent.async_result.successful()
    with pytest.raises(TaskCancelled):
        dropped.get(timeout=10)


# -- the other processes of the deployment, each started as the docs start it --------------------

class Services:
    def __init__(self, api_url: str, flower_url: str, flower_auth: tuple[str, str], logs):
        self.api_url, self.flower_url, self.flower_auth, self.logs = api_url, flower_url, flower_auth, logs


def wait_for_http(url: str, child: processes.Child, auth=None, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert child.alive(), f"{child.argv} exited: see {child.log_path}"
        try:
            if httpx.get(url, auth=auth, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not up in {timeout_s} s: see {child.log_path}")


@pytest.fixture(scope="module")
def services(deployment, tmp_path_factory):
    """Beat (``celery -A beat.app beat``), ``gateway api`` and ``gateway flower`` on the
    deployment's environment, started together, stopped after the module."""
    d = deployment
    logs = tmp_path_factory.mktemp("cluster-services")
    api_port, flower_port = free_port(), free_port()
    flower_auth = flower_cli.generated_basic_auth()
    children = {
        "beat": processes.beat(d.settings, schedule_path=str(logs / "beat-schedule"), loglevel="info",
                               log_path=str(logs / "beat.log")),
        "api": processes.api(d.env(), port=api_port, log_path=str(logs / "api.log")),
        "flower": processes.Child(processes.gateway_argv("flower", "--port", str(flower_port)),
                                  {**d.env(), flower_cli.AUTH_ENV: flower_auth}, str(logs / "flower.log")),
    }
    for child in children.values():
        child.start()
    try:
        api_url, flower_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{flower_port}"
        user, password = flower_cli.first_credentials(flower_auth)
        wait_for_http(f"{api_url}/healthz", children["api"])
        wait_for_http(f"{flower_url}/healthcheck", children["flower"], auth=(user, password))
        yield Services(api_url, flower_url, (user, password), logs)
        assert all(c.alive() for c in children.values()), {n: c.log_path for n, c in children.items()}
    finally:
        for child in children.values():
            child.stop()


def gateway_cli(d: Deployment, *argv: str) -> subprocess.CompletedProcess:
    """``gateway ARGV...`` as a process on the deployment's environment; it printed no secret."""
    run = subprocess.run(processes.gateway_argv(*argv), env=d.env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, (argv, run.stderr[-2000:])
    assert not any(s in run.stdout + run.stderr for s in SECRETS), argv
    return run


def test_beat_as_a_process_fires_a_tenant_cron_whose_result_is_read(deployment, services):
    d = deployment
    tenant, _ = d.tenant("vip")
    store = CronStore(d.gw.r, d.settings, d.gw)
    # registered as of a minute ago: its run of the minute just gone is due now (vip: no jitter)
    store.add(tenant, "digest", "* * * * *", {"messages": HELLO, "model": d.models[d.pools[0]], "max_tokens": 8},
              now=now_ms() - 60_000)
    deadline = time.monotonic() + 30
    while (fired := store.get(tenant, "digest")).last_task_id is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fired.last_task_id, (services.logs / "beat.log").read_text()[-2000:]
    assert fired.last_status == "fired"
    result = d.gw.result(fired.last_task_id).get(timeout=30)
    assert result["tenant_id"] == tenant and result["response"]["model"] == d.models[d.pools[0]]
    published = json.loads(gateway_cli(d, "capacity", "forecast", "--published", "--json").stdout)
    assert published["generated_ms"] > 0        # the leader's forecast, written in the beat's slot


def test_gateway_api_as_a_process_serves_completions_and_metrics_from_the_cluster(deployment, services):
    d = deployment
    tenant, key = d.tenant("normal")
    for pool in d.pools:
        reply = httpx.post(f"{services.api_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": d.models[pool], "messages": HELLO, "max_tokens": 8}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == d.models[pool] and reply.json()["choices"][0]["message"]["content"]
    assert httpx.get(f"{services.api_url}/metrics", timeout=10).status_code == 401
    scraped = httpx.get(f"{services.api_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert scraped.status_code == 200
    metrics = scraped.text
    for pool in d.pools:     # each pool's counters and bucket, read from its own master
        assert f'gateway_completed_tasks_total{{pool="{pool}",tier="normal"}}' in metrics, metrics
        assert f'gateway_bucket_capacity_tokens{{pool="{pool}"}}' in metrics
    assert float(re.search(r"^gateway_tenants (\S+)$", metrics, flags=re.M).group(1)) >= 2
    assert not any(s in metrics for s in SECRETS)


def test_flower_shows_the_clusters_workers_and_task_events_and_no_secret(deployment, services):
    d = deployment
    tenant, key = d.tenant("vip")
    handles = [d.gw.submit(tenant, f"flower {p}", model=d.models[p], max_tokens=8) for p in d.pools]
    for h in handles:
        h.get(timeout=30)
    base = services.flower_url
    for path in ("/", "/api/workers", "/metrics"):
        assert httpx.get(base + path, timeout=5).status_code == 401, path
    with httpx.Client(auth=services.flower_auth, timeout=10) as client:
        workers = processes.poll_json(client, f"{base}/api/workers?refresh=1",
                       lambda body: all(any(n.startswith(f"cl-{p}-") for n in body) for p in d.pools))
        tasks = processes.poll_json(client, f"{base}/api/tasks",
                     lambda body: all(body.get(h.id, {}).get("state") == "SUCCESS" for h in handles))
        assert {tasks[h.id]["name"] for h in handles} == {"gateway.infer"}
        assert all("flower" not in (tasks[h.id].get("args") or "") for h in handles)   # no prompt shown
        names = sorted(workers)
        pages = ["/", "/workers", "/tasks", "/broker", "/api/tasks", "/api/task/types",
                 *(f"/worker/{n}" for n in names), *(f"/task/{h.id}" for h in handles)]
        scraped = {}
        for path in pages:
            resp = client.get(base + path)
            assert resp.status_code == 200, (path, resp.text[:300])
            scraped[path] = resp.text
    served = "\n".join(scraped.values()) + json.dumps(workers)
    assert not any(s in served for s in (*SECRETS, key, services.flower_auth[1]))


def test_the_operator_commands_read_the_cluster(deployment):
    """`gateway cron add`, `metrics`, `status`, `capacity`, `capacity forecast`, `dead-letters`
    and `tenant usage`, each a process on the deployment's environment."""
    d = deployment
    a, b = d.pools
    tenant, _ = d.tenant("batch")
    for h in [d.gw.submit(tenant, f"usage {p}", model=d.models[p], max_tokens=8) for p in d.pools]:
        h.get(timeout=30)
    tag = uuid.uuid4().hex          # a malformed message on the second pool: its worker dead-letters it
    assert enqueue(d.gw.r, EnqueueCall(d.keys, d.settings.tier("vip"), b, tenant, tag, 10, "[1, 2]")).accepted
    deadline = time.monotonic() + 20
    while not dead_letters(d.gw.r, d.keys, b) and time.monotonic() < deadline:
        time.sleep(0.1)
    cron_tenant, _ = d.tenant("vip")
    gateway_cli(d, "cron", "add", cron_tenant, "minutely", "* * * * *", "--prompt", "tick", "--model", d.models[a])
    commands = {"metrics": ("metrics",), "status": ("status",),
                "capacity": ("capacity", "--from-deployment", "--measure-s", "1", "--p99-target-ms", "3000",
                             "--tasks-per-tenant-per-hour", "3", "--peak-multiplier", "2", "--json"),
                "forecast": ("capacity", "forecast", "--json"),
                "dead-letters": ("dead-letters", "--pool", b), "usage": ("tenant", "usage", tenant)}
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(commands, pool.map(lambda argv: gateway_cli(d, *argv), commands.values())))
    metrics = runs["metrics"].stdout
    assert all(f'gateway_completed_tasks_total{{pool="{p}",tier="batch"}}' in metrics for p in d.pools), metrics
    assert f'gateway_dead_lettered_messages_total{{pool="{b}",tier="vip"}} 1.0' in metrics
    assert all(pool in runs["status"].stdout for pool in d.pools)
    capacity = json.loads(runs["capacity"].stdout)
    assert capacity["measured"]["workers"] == 2            # `inspect stats` over the control Redis
    assert capacity["deployed"]["tenants"] >= 2 and capacity["deployed"]["completed"] >= 2
    forecast = json.loads(runs["forecast"].stdout)         # the cron's runs, read from the beat's slot
    assert sum(sum(s["runs"]) for s in forecast["series"] if s["pool"] == a and s["tier"] == "vip") >= 9
    [letter] = json.loads(runs["dead-letters"].stdout)
    assert letter["tag"] == tag and "not a JSON object" in letter["reason"]
    usage = json.loads(runs["usage"].stdout)
    assert usage["tenant_id"] == tenant and usage["totals"]["hours"]["requests"] == 2


def test_the_demo_runs_on_a_cluster(redis_cluster, redis_url):
    """`make demo` with a cluster URL and a control Redis (docs/redis-cluster.md), shortened; it
    leaves no key behind on either."""
    env = {**processes.without_settings_env(os.environ), "GATEWAY_CONTROL_REDIS_URL": redis_url,
           "REDIS_URL": "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports[:2])}
    demo = subprocess.Popen([sys.executable, "-m", "devtools", "demo", "--batch", "10", "--vip", "6",
                             "--batch-api-lines", "4"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:             # stuck: interrupted, it stops its worker and Flower
            demo.send_signal(signal.SIGINT)
            demo.communicate(timeout=30)
    assert demo.returncode == 0, out[-2000:] + err[-2000:]
    assert re.search(r"^vip\s+6\s", out, flags=re.M) and "completed, 4/4 completed" in out
    prefix = f"gt-demo-{demo.pid}:"           # the demo's own keys
    with redis.Redis.from_url(redis_url) as control:
        assert not list(control.scan_iter(match=f"{prefix}*", count=1000))
    assert not keys_on(redis_cluster, f"{prefix}*")


def test_a_master_restarted_mid_run_loses_nothing(deployment):
    """Tasks in flight on both pools while the master of the first pool's slot restarts:
    every accepted task completes once; submits refused while it is down are retried."""
    d = deployment
    a, b = d.pools
    tenant, _ = d.tenant("vip")

    def submit(pool: str, i: int):
        for _ in range(100):
            try:
                return d.gw.submit(tenant, f"restart {pool} {i}", model=d.models[pool], max_tokens=250)   # ~0.3 s
            except RedisUnavailable:
                time.sleep(0.1)
        raise AssertionError("submits refused for 10 s")

    handles = [submit(p, i) for p in (a, b) for i in range(8)]
    with ThreadPoolExecutor(1) as bg:
        restarted = bg.submit(d.cluster.restart, d.master_of(a))
        handles += [submit(p, i) for p in (a, b) for i in range(8, 12)]
        restarted.result(timeout=30)
    handles += [submit(p, i) for p in (a, b) for i in range(12, 14)]
    results = [h.get(timeout=60) for h in handles]
    assert len({r["task_id"] for r in results}) == len(handles) == 28
    for pool in (a, b):
        assert acked(d, pool) and d.gw.r.zcard(d.keys.index(pool, "vip")) == 0
