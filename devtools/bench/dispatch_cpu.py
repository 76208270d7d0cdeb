"""`gateway-dev bench-dispatch`, part 3: Redis CPU per task, end to end.

On a private Redis, per prompt size, three flows of ``tasks`` tasks each, one
worker process apiece (threads, task events on: ``processes.celery_worker_argv``
passes ``-E``, and producers send task-sent events):

* **plain** -- plain Celery (``bench.plain``'s app and worker, kombu's Redis
  transport) running the no-op task ``gateway.noop``; the prompt rides in a
  message header, so the message carries it as the gateway's does;
* **gateway noop** -- the gateway transport (enqueue.lua, pick.lua + the
  bell, release.lua) on the same no-op task and header, a pool that never
  waits: the transport's own cost;
* **gateway infer** -- ``Gateway.submit`` of ``gateway.infer`` tasks to a fast
  upstream simulator: submit -> enqueue -> pick -> upstream -> settle ->
  sync -> release -> result, the whole life of a real task.

The worker is started and answers a ping first; then the window: every task
is submitted, the run waits until every result is stored, and reads them all
once (as a client would).  Redis CPU per task = the server's CPU seconds over
the window (INFO cpu: user + sys, its background threads included) / tasks.
Idle workers poll in the window too (BLPOP / BRPOP timeouts, pidbox), alike
for every flow.

Where the time goes: each flow runs once more with the slowlog recording
every command (``redis_stats.recording``); the commands clients sent are
grouped by purpose (``command_purpose``): EVALSHA by script (calibrated to
the measured run's EVALSHA time), PUBLISH by channel (task events, results),
the result backend, the bell...  That run is not used for the CPU figures
(the slowlog costs CPU of its own).  The bench's own polling for results
(``wait_all``) shows up as ``exists`` and ``mget``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import redis
from celery import Celery

from gateway_tasks.core.celery_app import make_app
from gateway_tasks.core.scripts import available, scripts_for
from gateway_tasks.core.settings import Pool, Settings
from devtools.quotas import for_load
from devtools import processes
from devtools.bench import command_purpose, redis_stats
from devtools.bench.dispatch_server import PROMPT_SIZES_B, prompt_of
from devtools.bench.plain import NOOP_TASK, PLAIN_QUEUE, UNLIMITED, plain_app, plain_worker
from devtools.run_redis import discard_prefix
from gateway_tasks.simulator import SimConfig, SimulatorProcess
from gateway_tasks.producer.gateway import Gateway

MODEL = "gpt-4o-mini"
TIER = "normal"
TENANTS = 4
PAYLOAD_HEADER = "gt_bench_payload"
COMPLETION_TOKENS = 8
FAST = 10**9               # TPM and RPM of the fast upstream: the bucket never waits
FLOWS = ("plain", "gateway_noop", "gateway_infer")
POLL_S = 0.05
MGET_CHUNK = 500
READY_STATES = ("SUCCESS", "FAILURE", "REVOKED")


@dataclass
class Flow:
    """One way of running tasks: its app, how a worker starts, how a task is sent."""

    name: str
    app: Celery
    start_worker: Callable[[], processes.Child]
    send: Callable[[int], str]      # task number -> task id
    prefix: str
    senders: int = 1                # threads sending (in task order per thread)


def plain_flow(url: str, prompt: str, log_dir: str) -> Flow:
    prefix = f"gt-bench-cpu-plain-{uuid.uuid4().hex[:8]}:"
    app = plain_app(url, prefix)

    def send(i: int) -> str:
        return app.send_task(NOOP_TASK, args=[i], queue=PLAIN_QUEUE,
                             headers={PAYLOAD_HEADER: prompt}).id
    return Flow("plain", app, lambda: plain_worker(
        url, prefix, concurrency=8, pool="threads",
        log_path=os.path.join(log_dir, "cpu-plain-worker.log")).start(), send, prefix)


def gateway_noop_flow(url: str, base: Settings, prompt: str, log_dir: str) -> Flow:
    prefix = f"gt-bench-cpu-noop-{uuid.uuid4().hex[:8]}:"
    settings = base.with_(redis_url=url, key_prefix=prefix, pools=(UNLIMITED,))
    queue = settings.queue_name(TIER, UNLIMITED.name)
    app = make_app(settings)

    def send(i: int) -> str:
        return app.send_task(NOOP_TASK, args=[i], queue=queue, headers={
            "gt_est_tokens": 1, "gt_tenant": f"noop-{i % TENANTS}", PAYLOAD_HEADER: prompt}).id
    return Flow("gateway_noop", app, lambda: processes.worker(
        settings, queues=[queue], concurrency=8, name="cpu-noop",
        log_path=os.path.join(log_dir, "cpu-gateway-noop-worker.log")).start(), send, prefix)


def gateway_infer_flow(client: redis.Redis, url: str, base: Settings, prompt: str, sim_url: str,
                       log_dir: str, *, tpm: int = FAST, burst_s: float = 60.0, tenants: int = TENANTS,
                       name: str = "gateway_infer") -> Flow:
    """``tpm``/``burst_s``: the pool's (the default never waits: a bucket-bound flow sets less)."""
    prefix = f"gt-bench-cpu-infer-{uuid.uuid4().hex[:8]}:"
    pool = Pool("default", base_url=sim_url, api_key="sk-bench", models=(MODEL,), tpm=tpm,
                rpm=FAST, burst_s=burst_s)
    settings = for_load(base.with_(redis_url=url, key_prefix=prefix, pools=(pool,)))
    gw = Gateway(settings, client=client)
    names = [f"infer-{k}" for k in range(tenants)]
    for tenant in names:
        gw.register_tenant(tenant, TIER)

    def send(i: int) -> str:
        return gw.submit(names[i % tenants], prompt, max_tokens=2 * COMPLETION_TOKENS,
                         source="bench",
                         extra_body={"sim_completion_tokens": COMPLETION_TOKENS}).id
    return Flow(name, gw.app, lambda: processes.worker(
        settings, concurrency=8, name="cpu-infer",
        log_path=os.path.join(log_dir, f"cpu-{name}-worker.log")).start(), send, prefix)


def fast_simulator() -> SimulatorProcess:
    return SimulatorProcess(SimConfig(tpm=FAST, rpm=FAST, burst_s=60.0, base_latency_ms=0.0,
                                      ms_per_output_token=0.0, models=(MODEL,)))


def script_names(client: redis.Redis) -> dict[str, str]:
    """SHA1 -> script name, for every script the gateway loads."""
    scripts = scripts_for(client)
    return {scripts.sha(name): name for name in available()}


def run_flow(client: redis.Redis, flow: Flow, tasks: int, *, timeout_s: float,
             record: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the flow's worker, then the measured window (module docstring); with
    ``record`` the slowlog entries of the window too (oldest first)."""
    worker = flow.start_worker()
    entries: list[dict[str, Any]] = []
    try:
        processes.wait_for_workers(flow.app, 1, timeout_s=60.0)
        with redis_stats.recording(client) if record else contextlib.nullcontext():
            p0, t0 = redis_stats.point(client), time.monotonic()
            metas = _window(client, flow, tasks, timeout_s, worker)
            p1, t1 = redis_stats.point(client), time.monotonic()
            if record:
                entries = redis_stats.slowlog_entries(client)
    finally:
        worker.stop()
        discard_prefix(client, flow.prefix)
        flow.app.close()
    ok = sum(1 for m in metas if m.get("status") == "SUCCESS")
    row = cpu_of(flow.name, tasks, len(metas), ok, p1.cpu_s - p0.cpu_s,
                 redis_stats.stats_delta(p0.commands, p1.commands), p1.reads - p0.reads)
    row["window_s"] = round(t1 - t0, 3)
    return row, entries


def wait_all(client: redis.Redis, keys: list[str], timeout_s: float,
             alive: Callable[[], bool]) -> list[dict[str, Any]]:
    """Every task's final result meta, read once as a client would.  First the last
    task's key is polled (one EXISTS), then the results not yet final (MGET): a key
    exists from STARTED on (task_track_started), so existence alone is not done."""
    deadline = time.monotonic() + timeout_s
    while keys and time.monotonic() < deadline and alive() and not client.exists(keys[-1]):
        time.sleep(POLL_S)
    final: dict[str, dict[str, Any]] = {}
    pending = list(keys)
    while pending and time.monotonic() < deadline:
        still = []
        for i in range(0, len(pending), MGET_CHUNK):
            part = pending[i:i + MGET_CHUNK]
            for key, raw in zip(part, client.mget(part)):
                meta = json.loads(raw) if raw is not None else None
                if meta is not None and meta.get("status") in READY_STATES:
                    final[key] = meta
                else:
                    still.append(key)
        pending = still
        if pending:
            time.sleep(POLL_S)
    return [final[k] for k in keys if k in final]


def _window(client: redis.Redis, flow: Flow, tasks: int, timeout_s: float,
            worker: processes.Child) -> list[dict[str, Any]]:
    if flow.senders > 1:
        with ThreadPoolExecutor(flow.senders) as pool:
            ids = list(pool.map(flow.send, range(tasks)))
    else:
        ids = [flow.send(i) for i in range(tasks)]
    return wait_all(client, [flow.app.backend.get_key_for_task(t) for t in ids], timeout_s,
                    worker.alive)


def breakdown_of(entries: list[dict[str, Any]], scripts: dict[str, str], clean: dict[str, Any],
                 tasks: int) -> dict[str, Any]:
    """Where a flow's Redis time goes per task: the commands clients sent, by purpose,
    EVALSHA by script calibrated to the clean run's EVALSHA time (command_purpose)."""
    top = redis_stats.top_level(entries)
    costs = command_purpose.breakdown(
        [e for e in top if redis_stats.entry_words(e)[0].lower() != "evalsha"], scripts)
    by_script, per_logged_us = command_purpose.calibrated(
        command_purpose.evalsha_by_script(entries, scripts), clean["evalsha_usec"])
    costs.update({f"evalsha {name}": cost for name, cost in by_script.items()})
    commands = per_task(costs, tasks)
    return {"commands": commands,
            "command_us_per_task": round(sum(c["us_per_task"] for c in commands.values()), 1),
            "slowlog_us_per_logged_command": round(per_logged_us, 2)}


def per_task(costs: dict[str, redis_stats.Cost], tasks: int) -> dict[str, dict[str, float]]:
    """Calls and microseconds per task of each command or purpose, largest first (pure)."""
    n = max(tasks, 1)
    return {name: {"calls_per_task": round(c.calls / n, 2), "us_per_task": round(c.usec / n, 2)}
            for name, c in sorted(costs.items(), key=lambda kv: -kv[1].usec)}


def cpu_of(flow: str, tasks: int, done: int, ok: int, cpu_s: float,
           commands: dict[str, redis_stats.Cost], reads: int = 0) -> dict[str, Any]:
    """A flow's window in numbers (pure).  ``reads``: the server's read events over the
    window, about one per client round trip (idle pollers' included)."""
    evalsha = commands.get("evalsha", redis_stats.Cost())
    return {"flow": flow, "tasks": tasks, "results": done, "succeeded": ok,
            "redis_cpu_s": round(cpu_s, 4),
            "redis_cpu_us_per_task": round(1e6 * cpu_s / tasks, 1) if tasks else None,
            "round_trips_per_task": round(reads / tasks, 2) if tasks else None,
            "evalsha_per_task": round(evalsha.calls / tasks, 2) if tasks else None,
            "evalsha_us_per_task": round(evalsha.usec / tasks, 1) if tasks else None,
            "evalsha_usec": evalsha.usec,
            "commands_us_per_task": round(sum(c.usec for c in commands.values()) / tasks, 1) if tasks else None}


def run(client: redis.Redis, url: str, base: Settings, *, tasks: int, log_dir: str,
        timeout_s: float = 120.0, breakdown: bool = True,
        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every flow at every prompt size; after each measured run, its recorded twin."""
    rows: list[dict[str, Any]] = []
    scripts = script_names(client)
    with fast_simulator() as sim:
        def flow(name: str, prompt: str) -> Flow:
            if name == "plain":
                return plain_flow(url, prompt, log_dir)
            if name == "gateway_noop":
                return gateway_noop_flow(url, base, prompt, log_dir)
            return gateway_infer_flow(client, url, base, prompt, sim.base_url, log_dir)

        for size_b in PROMPT_SIZES_B:
            for name in FLOWS:
                row, _ = run_flow(client, flow(name, prompt_of(size_b)), tasks, timeout_s=timeout_s)
                row["prompt_b"] = size_b
                if breakdown:
                    rec, entries = run_flow(client, flow(name, prompt_of(size_b)), tasks,
                                            timeout_s=timeout_s, record=True)
                    row["breakdown"] = breakdown_of(entries, scripts, row, tasks)
                    row["breakdown"]["recorded_run_succeeded"] = rec["succeeded"]
                rows.append(row)
                progress(f"  {name:<14} {size_b:>5} B prompts: {row['redis_cpu_us_per_task']} us "
                         f"Redis CPU per task ({row['succeeded']}/{tasks} ok)")
    return {"tasks": tasks, "flows": rows}
