"""`gateway-dev bench-dispatch`, part 2: dispatches per second from one Redis.

``dispatchers`` processes (no GIL between them) each loop: pick.lua
(``PickPlan`` of all the pool's tiers, one task a call or a batch of 8),
then lua/dispatch/release.lua to ack what it picked -- one dispatch, two round trips
-- until its share of the queued messages is done.  Beside it the same number
of processes RPOP a plain list holding the same messages.  All processes
start together (an Event, once every one is connected with its scripts
loaded); the rate is all operations / (last end - first start), both
CLOCK_MONOTONIC, which every process shares.

The Redis side is measured too: its CPU seconds over the run (INFO cpu) per
operation, and what share of one core it was busy.  A client-bound run (the
dispatchers share the machine's cores with Redis) shows a Redis far from
busy; 1 / (Redis CPU per dispatch) is then the ceiling Redis itself sets.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from typing import Any

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.packer import connection_kwargs
from gateway_tasks.core.scripts import scripts_for, source
from gateway_tasks.core.settings import Settings, settings_from_json, settings_to_json
from devtools.bench import dispatch_server
from devtools.bench import redis_stats
from devtools.run_redis import discard_prefix
from gateway_tasks.dispatch.release import ReleaseCall
from gateway_tasks.dispatch.router import PickPlan

START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 300.0
BATCH_PICKS = dispatch_server.BATCH_PICKS


def _dispatch_loop(url: str, settings_json: str, per_call: int, count: int, ready: Any, go: Any,
                   out: Any) -> None:
    """One dispatcher with ``per_call`` free slots (a child process): one pick.lua call
    takes up to that many, one pipeline acks them (release.lua), until ``count`` are done."""
    client = redis.Redis.from_url(url, **connection_kwargs())   # as the workers' connections
    settings = settings_from_json(settings_json)
    keys = Keys(settings.key_prefix)
    batch = PickPlan(settings, settings.queue_names()).batch(per_call)
    scripts = scripts_for(client)
    for name in ("dispatch/pick", "dispatch/release"):
        client.script_load(source(name))
    ready.put(1)
    go.wait(START_TIMEOUT_S)
    done, t0 = 0, time.monotonic()
    while done < count:
        picked = scripts.run(batch)
        if not isinstance(picked, list):
            break
        # one pipeline of plain EVALSHAs, as the workers send theirs (no SCRIPT EXISTS first)
        scripts.run_together([ReleaseCall(keys, settings, p.pool, p.tag) for p in picked])
        done += len(picked)
    out.put((done, t0, time.monotonic()))


def _rpop_loop(url: str, key: str, count: int, ready: Any, go: Any, out: Any) -> None:
    """One plain consumer: RPOP up to ``count`` times (a child process)."""
    client = redis.Redis.from_url(url)
    client.ping()
    ready.put(1)
    go.wait(START_TIMEOUT_S)
    done, t0 = 0, time.monotonic()
    for _ in range(count):
        if client.rpop(key) is None:
            break
        done += 1
    out.put((done, t0, time.monotonic()))


def concurrently(client: redis.Redis, target: Any, args: tuple, processes: int, count: int) -> dict[str, Any]:
    """Run ``target(*args, count, ready, go, out)`` in ``processes`` processes at once."""
    ctx = multiprocessing.get_context("fork")   # no threads here; spawn would re-run the CLI
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, count, ready, go, out), daemon=True)
             for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=START_TIMEOUT_S)
        before = redis_stats.cpu_s(client)
        go.set()
        runs = [out.get(timeout=RUN_TIMEOUT_S) for _ in procs]
        after = redis_stats.cpu_s(client)
    finally:
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
    return rate_of(runs, after - before)


def rate_of(runs: list[tuple[int, float, float]], redis_cpu_s: float) -> dict[str, Any]:
    """Operations per second over all runs, and what Redis spent (pure)."""
    ops = sum(r[0] for r in runs)
    wall_s = max(r[2] for r in runs) - min(r[1] for r in runs) if runs else 0.0
    cpu_per_op_us = 1e6 * redis_cpu_s / ops if ops else None
    return {"processes": len(runs), "operations": ops, "wall_s": round(wall_s, 3),
            "per_s": round(ops / wall_s) if wall_s > 0 else None,
            "redis_cpu_s": round(redis_cpu_s, 3),
            "redis_busy_pct": round(100.0 * redis_cpu_s / wall_s, 1) if wall_s > 0 else None,
            "redis_cpu_us_per_op": round(cpu_per_op_us, 1) if cpu_per_op_us else None,
            "redis_ceiling_per_s": round(1e6 / cpu_per_op_us) if cpu_per_op_us else None}


def run(client: redis.Redis, url: str, base: Settings, *, messages: int, processes: int,
        tenants: int = 100) -> dict[str, Any]:
    """Gateway dispatchers, then plain RPOP loops, on the same messages (600 B prompts)."""
    prompt_b = dispatch_server.PROMPT_SIZES_B[0]
    message = dispatch_server.real_message(client, base, dispatch_server.prompt_of(prompt_b))
    prefix = f"gt-bench-rate-{uuid.uuid4().hex[:8]}:"
    settings = dispatch_server.bench_settings(base, prefix)
    list_key = f"{prefix}plain-list"
    per_process = -(-messages // processes)
    try:
        dispatch_server.fill(client, settings, dispatch_server.Scenario(prompt_b, tenants, messages,
                                                                        messages), message)
        gateway = concurrently(client, _dispatch_loop, (url, settings_to_json(settings), 1),
                               processes, per_process)
        dispatch_server.fill(client, settings, dispatch_server.Scenario(prompt_b, tenants, messages,
                                                                        messages), message)
        batched = concurrently(client, _dispatch_loop, (url, settings_to_json(settings), BATCH_PICKS),
                               processes, per_process)
        for part in dispatch_server.chunks(messages, dispatch_server.PIPELINE_CHUNK):
            with client.pipeline(transaction=False) as pipe:
                for _ in part:
                    pipe.lpush(list_key, message)
                pipe.execute()
        plain = concurrently(client, _rpop_loop, (url, list_key), processes, per_process)
    finally:
        discard_prefix(client, prefix)
    return {"prompt_b": prompt_b, "messages": messages, "tenants": tenants,
            "gateway": gateway, "gateway_batched": batched, "batch_picks": BATCH_PICKS,
            "plain_rpop": plain}
