"""`gateway-dev bench`, part 3: the gateway transport against plain Celery.

The same trivial task (``gateway.noop``: no upstream call) goes through

* **plain** -- a stock Celery app on kombu's own Redis transport (BRPOP, and
  kombu's ack emulation: one pipeline recording the unacked message, one
  removing it at ack), with the gateway app's settings otherwise: JSON, late
  acks, prefetch 1, task events, stock Celery's Redis result backend with the
  same key prefix scheme; and
* **gateway** -- ``gateway_tasks.core.celery_app`` on the gateway transport
  (pick.lua + the bell), queue ``gt.vip.default``, headers ``gt_est_tokens=1``
  and ``gt_tenant``, on a pool whose TPM/RPM are so large the bucket never
  waits: only the transport's own cost is measured.

For each, N tasks are enqueued first, then one worker (same pool and
concurrency) is started and drains them.  Throughput is N / (last result
stored - first task started), both read from the results (``date_done`` and
the task's own start time), so worker start-up is excluded alike.  Runs
alternate (plain, gateway, gateway, plain, ...) so drift hits both.

Redis round trips per message: gateway from the transport's own counters
(``Keys.dispatch_stats``: picks + bell waits); plain from INFO commandstats
deltas (BRPOP calls + ZADD calls, one per unacked-record pipeline).  Both
then ack with one pipeline per message.  commandstats are server-wide, so on
a shared Redis other clients' BRPOP/ZADD inflate the plain figure a little.

This module is also the ``-A`` target of the plain worker:
``celery -A devtools.bench.plain worker`` builds its app from
GT_BENCH_PLAIN_URL and GT_BENCH_PLAIN_PREFIX.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime
from typing import Any, Iterable, Sequence

import redis
from celery import Celery

from gateway_tasks.core.celery_app import celery_config, make_app
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, Settings
from devtools import processes
from devtools.bench.results import count_existing, result_metas
from devtools.measure import counter_delta
from devtools.run_redis import discard_prefix
from gateway_tasks.core.stats import DISPATCH_DISPATCHED, DISPATCH_PICKS, DISPATCH_WAITS

NOOP_TASK = "gateway.noop"
PLAIN_QUEUE = "bench.plain"
GATEWAY_QUEUE_TIER = "vip"
URL_ENV = "GT_BENCH_PLAIN_URL"
PREFIX_ENV = "GT_BENCH_PLAIN_PREFIX"
UNLIMITED = Pool("default", base_url="http://127.0.0.1:9/v1", api_key="unused", models=("noop",),
                 tpm=10**12, rpm=10**12, burst_s=60.0)
NOOP_TENANTS = 4


# -- the plain Celery app -----------------------------------------------------
def plain_app(redis_url: str, prefix: str) -> Celery:
    """A stock Celery app (kombu's redis transport) configured like the gateway's."""
    conf = celery_config(Settings(), redis_url)
    conf.pop("broker_transport")
    conf.update(
        broker_transport_options={"global_keyprefix": prefix,
                                  "visibility_timeout": Settings().visibility_timeout_s},
        # stock Celery's Redis backend (its read before every result write included): the
        # gateway's own backend writes a result in one round trip (core/result_backend.py)
        result_backend=redis_url,
        result_backend_transport_options={"global_keyprefix": prefix},
        task_default_queue=PLAIN_QUEUE,
    )
    app = Celery("bench-plain")
    app.conf.update(conf)
    import workers.tasks  # noqa: F401  (registers gateway.noop on shared_task apps)
    return app


def __getattr__(name: str) -> Any:
    # `celery -A devtools.bench.plain worker` looks up `app` lazily
    if name in ("app", "celery"):
        url, prefix = os.environ.get(URL_ENV), os.environ.get(PREFIX_ENV)
        if not url or not prefix:
            raise AttributeError(f"{name}: set {URL_ENV} and {PREFIX_ENV}")
        return plain_app(url, prefix)
    raise AttributeError(name)


def plain_worker(redis_url: str, prefix: str, *, concurrency: int, pool: str,
                 log_path: str = "") -> processes.Child:
    """A plain Celery worker with the same flags processes.worker() gives gateway workers."""
    argv = processes.celery_worker_argv("devtools.bench.plain", [PLAIN_QUEUE],
                                        concurrency=concurrency, pool=pool, name="plain")
    env = processes.without_settings_env(os.environ)
    env.update({URL_ENV: redis_url, PREFIX_ENV: prefix})
    return processes.Child(argv, env, log_path)


# -- measuring ----------------------------------------------------------------
def commandstats(client: redis.Redis) -> dict[str, int]:
    """INFO commandstats as {command: calls} (lower-case names)."""
    out: dict[str, int] = {}
    for key, value in client.info("commandstats").items():
        name = key.removeprefix("cmdstat_")
        out[name] = int(value["calls"]) if isinstance(value, dict) else 0
    return out


def _parse_done(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def wait_for_results(client: redis.Redis, keys: Sequence[bytes | str], timeout_s: float,
                     alive: Any = None) -> int:
    """Poll until every result key exists; returns how many do at the end."""
    deadline = time.monotonic() + timeout_s
    found = 0
    while time.monotonic() < deadline:
        found = count_existing(client, keys)
        if found >= len(keys) or (alive is not None and not alive()):
            return found
        time.sleep(0.05)
    return found


def throughput_of(metas: Iterable[dict[str, Any]]) -> dict[str, Any]:
    metas = [m for m in metas if m.get("status") == "SUCCESS"]
    if not metas:
        return {"tasks": 0, "elapsed_s": None, "tasks_per_s": None}
    first = min(float(m["result"]["started"]) for m in metas)
    last = max(_parse_done(m["date_done"]) for m in metas)
    elapsed = max(last - first, 1e-6)
    return {"tasks": len(metas), "elapsed_s": round(elapsed, 4),
            "tasks_per_s": round(len(metas) / elapsed, 1)}


def run_plain(client: redis.Redis, redis_url: str, *, tasks: int, concurrency: int, pool: str,
              log_dir: str, timeout_s: float) -> dict[str, Any]:
    prefix = f"gt-bench-plain-{uuid.uuid4().hex[:8]}:"
    app = plain_app(redis_url, prefix)
    try:
        ids = [str(uuid.uuid4()) for _ in range(tasks)]
        with app.producer_or_acquire() as producer:
            for i, task_id in enumerate(ids):
                app.send_task(NOOP_TASK, args=[i], task_id=task_id, queue=PLAIN_QUEUE,
                              producer=producer)
        keys = [app.backend.get_key_for_task(t) for t in ids]
        before = commandstats(client)
        worker = plain_worker(redis_url, prefix, concurrency=concurrency, pool=pool,
                              log_path=os.path.join(log_dir, "plain-worker.log")).start()
        try:
            done = wait_for_results(client, keys, timeout_s, worker.alive)
            after = commandstats(client)
        finally:
            worker.stop()
        metas = result_metas(client, keys)
    finally:
        discard_prefix(client, prefix)
        app.close()
    out = throughput_of(metas)
    brpop, zadd, zrem = (counter_delta(before, after, c) for c in ("brpop", "zadd", "zrem"))
    n = max(done, 1)
    out.update({
        "prefix": prefix,
        "completed": done,
        "dispatch_round_trips_per_msg": round((brpop + zadd) / n, 3),
        "ack_round_trips_per_msg": round(zrem / n, 3),
        "counted": {"brpop": brpop, "zadd_unacked_record": zadd, "zrem_ack": zrem},
    })
    return out


def run_gateway(client: redis.Redis, base: Settings, redis_url: str, *, tasks: int,
                concurrency: int, pool: str, log_dir: str, timeout_s: float) -> dict[str, Any]:
    prefix = f"gt-bench-noop-{uuid.uuid4().hex[:8]}:"
    settings = base.with_(redis_url=redis_url, key_prefix=prefix, pools=(UNLIMITED,))
    keys_of = Keys(prefix)
    queue = settings.queue_name(GATEWAY_QUEUE_TIER, UNLIMITED.name)
    app = make_app(settings)
    try:
        ids = [str(uuid.uuid4()) for _ in range(tasks)]
        with app.producer_or_acquire() as producer:
            for i, task_id in enumerate(ids):
                app.send_task(NOOP_TASK, args=[i], task_id=task_id, queue=queue, producer=producer,
                              headers={"gt_est_tokens": 1, "gt_tenant": f"noop-{i % NOOP_TENANTS}"})
        keys = [app.backend.get_key_for_task(t) for t in ids]
        worker = processes.worker(settings, queues=[queue], concurrency=concurrency, pool=pool,
                                  log_path=os.path.join(log_dir, "gateway-noop-worker.log")).start()
        try:
            done = wait_for_results(client, keys, timeout_s, worker.alive)
        finally:
            worker.stop()  # closing the channel flushes its dispatch counters
        metas = result_metas(client, keys)
        counts = {k.decode(): int(v) for k, v in client.hgetall(keys_of.dispatch_stats).items()}
    finally:
        discard_prefix(client, prefix)
        app.close()
    out = throughput_of(metas)
    dispatched = max(counts.get(DISPATCH_DISPATCHED, 0), 1)
    out.update({
        "prefix": prefix,
        "completed": done,
        "dispatch_round_trips_per_msg": round((counts.get(DISPATCH_PICKS, 0)
                                               + counts.get(DISPATCH_WAITS, 0)) / dispatched, 3),
        "ack_round_trips_per_msg": 1.0,
        "counted": counts,
    })
    return out


def compare(client: redis.Redis, base: Settings, redis_url: str, *, tasks: int, repeats: int,
            concurrency: int, pool: str, log_dir: str, timeout_s: float = 120.0,
            progress: Any = None) -> dict[str, Any]:
    """Alternating plain/gateway runs; the ratio compares the best of each (least disturbed)."""
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "gateway": []}
    order = []
    for rep in range(repeats):
        order += ["plain", "gateway"] if rep % 2 == 0 else ["gateway", "plain"]
    for kind in order:
        if kind == "plain":
            res = run_plain(client, redis_url, tasks=tasks, concurrency=concurrency, pool=pool,
                            log_dir=log_dir, timeout_s=timeout_s)
        else:
            res = run_gateway(client, base, redis_url, tasks=tasks, concurrency=concurrency,
                              pool=pool, log_dir=log_dir, timeout_s=timeout_s)
        runs[kind].append(res)
        if progress:
            progress(f"  {kind:<8} {res['completed']}/{tasks} tasks, "
                     f"{res['tasks_per_s']} tasks/s")
    best = {k: max((r["tasks_per_s"] or 0.0) for r in v) for k, v in runs.items()}
    mean = {k: sum((r["tasks_per_s"] or 0.0) for r in v) / len(v) for k, v in runs.items()}
    ratio = best["plain"] / best["gateway"] if best["gateway"] else None
    return {
        "task": NOOP_TASK, "tasks": tasks, "repeats": repeats, "concurrency": concurrency,
        "pool": pool, "order": order, "runs": runs,
        "best_tasks_per_s": best, "mean_tasks_per_s": {k: round(v, 1) for k, v in mean.items()},
        "overhead_x": round(ratio, 3) if ratio else None,
    }
