"""`gateway-dev bench-cluster`: the dispatch path's scale-out from one Redis Cluster master to three.

``pools`` pools (default 6) run on a real Redis Cluster on loopback
(``devtools.redis_cluster.EmbeddedRedisCluster``, AOF on as deployed), once with 1 master
and once with ``shards`` masters (default 3) -- a 1-shard cluster, so both sides pay
cluster mode alike.  The pools' names are chosen so that their hash tags (``{p:<pool>}``,
``Keys.pool_tag``) spread evenly over the masters of the larger cluster
(``place_pools``); the same names run on both.

One driver process per pool (no GIL between them), each with a plain connection to the
master that owns its pool's slot, runs the dispatch path of a task over and over, the
Lua scripts a real task runs, one round trip each:

* enqueue -- the message (HSET) and lua/dispatch/enqueue.lua in one MULTI
  (``gateway_tasks.dispatch.enqueue.enqueue``), into the ``normal`` tier, tenants in turn;
* pick -- lua/dispatch/pick.lua over all the pool's tiers (``PickPlan``, as a worker that
  serves the pool calls it), one task a call;
* settle -- lua/bucket/settle.lua with the reply's usage and rate-limit headers
  (``SettleCall``, as the task's end does);
* release -- lua/dispatch/release.lua acking it (``ReleaseCall``, as the worker's ack does).

Each pool keeps a backlog of ``backlog`` queued tasks over ``tenants`` tenants, so a pick
chooses among queued tenants as under load; its bucket never waits.  Before the window
every driver warms up (scripts loaded, the Lua heap grown), then all start together (an
Event) and run for ``window_s`` seconds.

Per master (shard), INFO cpu (used_cpu_user + used_cpu_sys) before and after the window:
Redis CPU per task = the CPU seconds / the tasks that shard dispatched (its pools'), and
its capacity when that CPU is the limit, 1 core / CPU per task.  The cluster's capacity
is the sum over its shards; with every pool equally loaded, the shard with the least
capacity per pool it holds caps them all (``cluster_report``).  Also measured: the
dispatches per second all drivers achieved, and how busy each shard was.  On a machine
with fewer cores than drivers + shards the Python drivers, not Redis, limit the measured
rate (the report says so when every shard stayed well below one core): the scale-out is
then judged on Redis CPU per task and the balance over the shards.

Each run starts a fresh cluster of each size (1 master first), ``runs`` runs; the report
gives the median and spread over them against the target (>= 2.7x from 1 to 3 masters).

    python -m devtools.bench.cluster [--quick] [--json] [--check]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import uuid
from queue import Empty
from typing import Any, Callable

import redis

from gateway_tasks.bucket.calls import SettleCall
from gateway_tasks.bucket.pool_bucket import LEARN_EWMA_WEIGHT
from gateway_tasks.core.errors import ConfigError, StartupError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.packer import connection_kwargs
from gateway_tasks.core.scripts import scripts_for, source
from gateway_tasks.core.settings import Pool, Settings, load_settings
from gateway_tasks.dispatch.enqueue import EnqueueCall, enqueue
from gateway_tasks.dispatch.release import ACK, ReleaseCall
from gateway_tasks.dispatch.router import PickPlan, Picked
from gateway_tasks.local.redis_server import EmbeddedRedis, redis_server_binary
from devtools.bench import cluster_report, redis_stats
from devtools.bench import command as bench_command
from devtools.bench.dispatch_server import PROMPT_SIZES_B, prompt_of, real_message
from devtools.quotas import for_load
from devtools.redis_cluster import HOST, EmbeddedRedisCluster, slot_of, slot_ranges

TIER = "normal"
MODEL = "noop"
FAST = 10**12                 # TPM and RPM of every pool: the bucket never waits
COMPLETION_TOKENS = 8
SCRIPTS = ("dispatch/enqueue", "dispatch/pick", "bucket/settle", "dispatch/release")
POOL_NAME = "pool-{:02d}"     # candidates, in order, for place_pools
START_TIMEOUT_S = 120.0
NO_AOF_REWRITE = ("auto-aof-rewrite-percentage", "0")   # no rewrite's fork inside a window
DEFAULTS = {"pools": 6, "shards": 3, "window_s": 10.0, "runs": 3, "backlog": 50, "tenants": 100,
            "warmup": 500}
QUICK = {"pools": 6, "shards": 3, "window_s": 3.0, "runs": 1, "backlog": 20, "tenants": 20,
         "warmup": 200}


def place_pools(count: int, shards: int) -> list[str]:
    """``count`` pool names whose hash tags fall evenly on the masters of a ``shards``-master
    cluster with the slots cut as ``slot_ranges`` cuts them (``redis-cli --cluster create``
    cuts them the same way): the candidates ``POOL_NAME`` in order, each taken when its master
    holds no more of them than any other, so the masters' counts differ by at most one (pure)."""
    if count < 1 or shards < 1:
        raise ConfigError(f"--pools and --shards must be positive, not {count} and {shards}")
    held = [0] * shards
    names: list[str] = []
    i = 0
    while len(names) < count:
        name = POOL_NAME.format(i)
        shard = shard_of_slot(pool_slot(name), shards)
        if held[shard] == min(held):
            held[shard] += 1
            names.append(name)
        i += 1
    return names


def pool_slot(pool: str) -> int:
    """The hash slot of a pool's dispatch state (any key prefix: only the tag is hashed)."""
    return slot_of(Keys().pool_tag(pool))


def shard_of_slot(slot: int, shards: int) -> int:
    """Which of ``shards`` consecutive slot ranges holds ``slot`` (0-based)."""
    return next(i for i, r in enumerate(slot_ranges(shards)) if slot in r)


def bench_pool(name: str) -> Pool:
    return Pool(name, base_url="http://127.0.0.1:9/v1", api_key="unused", models=(MODEL,), tpm=FAST,
                rpm=FAST, burst_s=60.0)


def owners(cluster: EmbeddedRedisCluster, pools: list[str]) -> dict[str, int]:
    """Pool -> the port of the master that owns its slot, as the cluster itself says
    (CLUSTER SLOTS, through redis-py's slot table)."""
    with cluster.client() as client:
        return {p: client.get_node_from_key(Keys().pool_tag(p)).port for p in pools}


# -- one driver: one pool's dispatch path, over and over -----------------------------
class Driver:
    """One pool's tasks through enqueue, pick, settle and release, on one master."""

    def __init__(self, client: redis.Redis, settings: Settings, pool: str, message: str, tenants: int):
        self.client = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.pool = settings.pool(pool)
        self.tier = settings.tier(TIER)
        self.tiers = tuple(t.name for t in settings.tiers)
        self.plan = PickPlan(settings, [settings.queue_name(t, pool) for t in self.tiers])
        self.scripts = scripts_for(client)
        self.message = message
        self.tenants = [f"tenant-{k}" for k in range(tenants)]
        self.sent = 0

    def load_scripts(self) -> None:
        for name in SCRIPTS:
            self.client.script_load(source(name))

    def enqueue_one(self) -> None:
        tenant = self.tenants[self.sent % len(self.tenants)]
        self.sent += 1
        got = enqueue(self.client, EnqueueCall(
            self.keys, self.tier, self.pool.name, tenant=tenant, tag=uuid.uuid4().hex, est_tokens=100,
            message_json=self.message, pool_capacity=self.pool.queue_capacity, pool_tiers=self.tiers,
            task_id=uuid.uuid4().hex, ref_ttl_s=self.settings.result_ttl_s))
        if not got.accepted:
            raise StartupError(f"pool {self.pool.name}: enqueue refused ({got})")

    def dispatch_one(self) -> None:
        """Pick one task, settle its usage, release it (the backlog stays as it was)."""
        picked = self.scripts.run(self.plan)
        if not isinstance(picked, Picked):
            raise StartupError(f"pool {self.pool.name}: nothing to pick ({picked}) with a backlog queued")
        picked = self.plan.with_payload(self.client, picked)
        self.scripts.run(SettleCall(
            self.keys, self.pool, tier=picked.tier, tenant_id=picked.tenant, model=MODEL,
            est_tokens=picked.est_tokens, actual_tokens=picked.est_tokens - 50,
            completion_tokens=COMPLETION_TOKENS, learn_weight=LEARN_EWMA_WEIGHT, give_back_request=False,
            remaining_tokens=FAST, remaining_requests=FAST,
            debited_tokens_at_dispatch=picked.pool_debited, dispatches_at_dispatch=picked.pool_dispatches))
        self.scripts.run(ReleaseCall(self.keys, self.settings, picked.pool, picked.tag, ACK,
                                     token=str(picked.dispatched_ms)))

    def task(self) -> None:
        self.enqueue_one()
        self.dispatch_one()


def _drive(port: int, settings: Settings, pool: str, message: str, sizes: dict[str, Any],
           ready: Any, go: Any, out: Any) -> None:
    """A driver process: backlog, warm-up, then tasks for the window; reports
    (pool, tasks, start, end) on ``out``, both times CLOCK_MONOTONIC (shared by every process)."""
    client = redis.Redis.from_url(f"redis://{HOST}:{port}", **connection_kwargs())   # as a worker's
    driver = Driver(client, settings, pool, message, sizes["tenants"])
    driver.load_scripts()
    for _ in range(sizes["backlog"]):
        driver.enqueue_one()
    for _ in range(sizes["warmup"]):
        driver.task()
    ready.put(pool)
    go.wait(START_TIMEOUT_S)
    done, t0 = 0, time.monotonic()
    end = t0 + sizes["window_s"]
    while time.monotonic() < end:
        driver.task()
        done += 1
    out.put((pool, done, t0, time.monotonic()))
    client.close()


# -- one topology, one run ---------------------------------------------------------------
def run_topology(shards: int, pools: list[str], settings: Settings, message: str,
                 sizes: dict[str, Any]) -> dict[str, Any]:
    """A fresh cluster of ``shards`` masters; one window with one driver per pool on its
    master (``together``); on more than one master, then one window per master with as many
    drivers as there are pools, on its pools only (``alone``: the master as loaded as the
    single master was)."""
    with EmbeddedRedisCluster(nodes=shards) as cluster:
        ports = cluster.ports
        nodes = {port: cluster.node_client(port) for port in ports}
        try:
            for node in nodes.values():
                node.config_set(*NO_AOF_REWRITE)
            owner = owners(cluster, pools)
            held = {port: [p for p in pools if owner[p] == port] for port in ports}
            together = _rows(_window([(p, owner[p]) for p in pools], settings, message, sizes, nodes), held)
            alone = []
            for i, port in enumerate(ports if shards > 1 else ()):
                mine = held[port]
                drivers = [(mine[d % len(mine)], port) for d in range(len(pools))] if mine else []
                alone.append(_rows(_window(drivers, settings, message, sizes, nodes), held)[i])
        finally:
            for node in nodes.values():
                node.close()
    return cluster_report.topology_run(shards, together, alone or together, len(pools))


Window = tuple[list[tuple[str, int, float, float]], dict[int, tuple[redis_stats.Point, redis_stats.Point]]]


def _rows(window: Window, held: dict[int, list[str]]) -> list[dict[str, Any]]:
    """A window as one row per master (``cluster_report.shard_row``), in port order of ``held``."""
    runs, points = window
    tasks: dict[str, int] = {}
    for pool, done, _, _ in runs:
        tasks[pool] = tasks.get(pool, 0) + done
    wall_s = max(r[3] for r in runs) - min(r[2] for r in runs) if runs else 0.0
    return [cluster_report.shard_row(
        shard=i + 1, port=port, pools=pools, tasks=sum(tasks.get(p, 0) for p in pools),
        cpu_s=points[port][1].cpu_s - points[port][0].cpu_s,
        commands=redis_stats.stats_delta(points[port][0].commands, points[port][1].commands),
        reads=points[port][1].reads - points[port][0].reads, window_s=wall_s)
        for i, (port, pools) in enumerate(held.items())]


def _window(drivers: list[tuple[str, int]], settings: Settings, message: str, sizes: dict[str, Any],
            nodes: dict[int, redis.Redis]) -> Window:
    """One driver process per (pool, master port) of ``drivers``, all started together; what
    each did and every master's INFO just before and just after."""
    # spawned, not forked: a fork of a process with threads (a test process holds Redis pools,
    # simulators and listeners) can copy a lock another thread holds, and the child then hangs
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_drive, args=(port, settings, pool, message, sizes, ready, go, out),
                         daemon=True) for pool, port in drivers]
    for p in procs:
        p.start()
    try:
        _await(ready, procs, len(procs), START_TIMEOUT_S, "warmed up")
        before = {port: redis_stats.point(node) for port, node in nodes.items()}
        go.set()
        runs = _await(out, procs, len(procs), START_TIMEOUT_S + sizes["window_s"], "done")
        after = {port: redis_stats.point(node) for port, node in nodes.items()}
    finally:
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
    return runs, {port: (before[port], after[port]) for port in nodes}


def _await(queue: Any, procs: list[Any], count: int, timeout_s: float, what: str) -> list[Any]:
    """``count`` items from ``queue``; StartupError as soon as a driver died, or at the timeout."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        try:
            got.append(queue.get(timeout=0.5))
            continue
        except Empty:
            pass
        dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise StartupError(f"{len(got)} of {count} drivers {what}"
                               + (f"; a driver exited with status {dead[0]} (its traceback is above)"
                                  if dead else f" after {timeout_s:.0f} s"))
    return got


# -- the whole bench ----------------------------------------------------------------------
def probe_message() -> tuple[str, str]:
    """The kombu message Gateway.submit queues for a 600 B prompt, made on a private Redis
    of the binary the clusters run, and that Redis's version."""
    with EmbeddedRedis(binary=redis_server_binary()) as server:
        client = redis.Redis.from_url(server.url)
        try:
            return (real_message(client, load_settings(env={}, redis_url=server.url),
                                 prompt_of(PROMPT_SIZES_B[0])),
                    str(client.info("server")["redis_version"]))
        finally:
            client.close()


def run_bench(sizes: dict[str, Any], progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    started = time.monotonic()
    pools = place_pools(sizes["pools"], sizes["shards"])
    settings = for_load(load_settings(env={}).with_(
        key_prefix=f"gt-bench-cluster-{uuid.uuid4().hex[:8]}:", pools=tuple(bench_pool(p) for p in pools)))
    message, version = probe_message()
    topologies = (1, sizes["shards"])
    result: dict[str, Any] = {
        "config": {**sizes, "cores": os.cpu_count(), "redis_version": version,
                   "prompt_b": PROMPT_SIZES_B[0], "message_b": len(message), "tier": TIER,
                   "scripts_per_task": list(SCRIPTS)},
        "placement": [{"pool": p, "slot": pool_slot(p), "shard": shard_of_slot(pool_slot(p), sizes["shards"]) + 1}
                      for p in pools],
        "runs": {str(k): [] for k in topologies}}
    for run in range(sizes["runs"]):
        for shards in topologies:
            got = run_topology(shards, pools, settings, message, sizes)
            result["runs"][str(shards)].append(got)
            progress(f"  run {run + 1}, {shards} master(s): {got['together']['dispatches_per_s']} dispatches/s "
                     f"with every pool driven; Redis CPU per task, each master alone: "
                     + ", ".join(f"{r['cpu_us_per_task']} us" for r in got["alone"]["shards"])
                     + f"; capacity {got['alone']['capacity_per_s']}/s")
    result["runtime_s"] = round(time.monotonic() - started, 1)
    return cluster_report.evaluate(result)


def sizes_from_args(args: argparse.Namespace) -> dict[str, Any]:
    preset = QUICK if args.quick else DEFAULTS
    sizes = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in preset.items()}
    if any(v <= 0 for v in sizes.values()):
        raise ConfigError("--pools, --shards, --window-s, --runs, --backlog, --tenants and --warmup "
                          "must be positive")
    if sizes["shards"] < 2:
        raise ConfigError(f"--shards {sizes['shards']}: the scale-out is measured from 1 master to 2 or more")
    return sizes


def run(args: argparse.Namespace) -> int:
    sizes = sizes_from_args(args)
    bench_command.progress(f"gateway-dev bench-cluster: {sizes['pools']} pools on 1 and on {sizes['shards']} "
                           f"masters, {sizes['runs']} run(s) of {sizes['window_s']} s")
    result = run_bench(sizes, progress=bench_command.progress)
    return bench_command.finish(args, result, cluster_report.format_report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, kind, help_text in (("pools", int, "pools, one driver process each"),
                                  ("shards", int, "masters of the larger cluster"),
                                  ("window_s", float, "seconds each window lasts"),
                                  ("runs", int, "runs (each: both cluster sizes, fresh)"),
                                  ("backlog", int, "tasks kept queued on every pool"),
                                  ("tenants", int, "tenants of every pool"),
                                  ("warmup", int, "tasks every driver runs before the window")):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None,
                            help=f"{help_text} (default {DEFAULTS[name]}, --quick {QUICK[name]})")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--quick", action="store_true", help="a short run at smaller sizes")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target fails")


def register(subparsers: Any) -> None:
    bench_command.register(subparsers, "bench-cluster",
                           "dispatch scale-out on Redis Cluster: Redis CPU per task on 1 and on 3 masters",
                           __doc__, add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return bench_command.standalone("devtools.bench.cluster", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
