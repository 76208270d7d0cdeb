"""Faults: Redis near its maxmemory, then at it (noeviction), on one deployment.

Near: with no worker running, Redis gets a maxmemory a few MiB above what it
uses and a tenant submits 8 KB prompts until refused.  The refusal must be a
clear ``RedisFull`` (Python) / 503 (REST), nothing may be evicted
(``evicted_keys`` stays 0, every accepted message is still there), and once a
worker starts -- maxmemory unchanged -- it must drain the queue by itself: the
producers stop short of the limit (``redis_memory_refuse_ratio``, at least
``redis_memory_reserve_mib`` below it) so that picks, acks, results and the
starting worker's connections still fit.

At: with that worker busy, maxmemory drops below what Redis uses for
``AT_MAX_S`` -- every write that may grow memory is refused: picks, settles,
results -- then goes back.  The worker must ride it out (it lives on; its tasks
wait, none is dropped), submits meanwhile are refused with ``RedisFull``, and
every task must end final.  ``AT_MAX_S`` is shorter than a lease: renewals are
refused too, and a lease that expired meanwhile would let a task run twice.
"""

from __future__ import annotations

import time

from gateway_tasks.core.errors import RedisFull
from devtools.chaos.deployment import POOL, Deployment
from devtools.chaos.outcome import Outcome
from devtools.chaos.redis_down import rest_submit
from devtools.chaos.workload import Size, Submitter, settle
from devtools.processes import Child
from gateway_tasks.simulator import SimConfig
from gateway_tasks.producer.memory_guard import MIB, refuse_at_bytes

NAME = "Redis near maxmemory (noeviction)"
NAME_AT_MAX = "Redis at maxmemory under a busy worker, 3 s"
PROMPT = "x " * 4000          # ~8 KB a message
MAX_SUBMITS = 5000
REST_TRIES = 10     # the API is a producer of its own: at the limit it may take one or two more
AT_MAX_S = 3.0
SLOW_MAX_TOKENS = 1000   # the busy worker's calls: ~0.3 s each at the simulator's 0.5 ms a token


def runs(size: Size) -> list[Outcome]:
    near = Outcome(NAME, recovery_target_s=60.0,
                   recovery_what="submits accepted again, after a worker starts (maxmemory unchanged)")
    at_max = Outcome(NAME_AT_MAX, recovery_target_s=30.0,
                     recovery_what="every task final (the queue drained), after maxmemory is back")
    sim = SimConfig(tpm=100_000_000, rpm=1_000_000, base_latency_ms=20, ms_per_output_token=0.5)
    with Deployment("memory", sim, pool_tpm=100_000_000, pool_rpm=1_000_000) as dep:
        worker = near_maxmemory(dep, size, near)
        at_maxmemory(dep, size, at_max, worker)
        dep.r.config_set("maxmemory", 0)
    return [near, at_max]


def near_maxmemory(dep: Deployment, size: Size, outcome: Outcome) -> Child:
    """The first fault; returns the worker it started."""
    key = dep.gw.register_tenant("acme", "vip")  # type: ignore[union-attr]
    _api, url = dep.api()
    used = int(dep.r.info("memory")["used_memory"])
    dep.r.config_set("maxmemory", used + size.memory_headroom_mib * MIB)
    sub = Submitter(dep)
    refusal = None
    for i in range(MAX_SUBMITS):
        try:
            h = dep.gw.submit("acme", PROMPT + str(i), max_tokens=8)  # type: ignore[union-attr]
            sub.ids.append(h.id)
        except Exception as exc:  # noqa: BLE001
            refusal = exc
            break
    outcome.refused[type(refusal).__name__ if refusal else "none"] += 1
    outcome.check("Python refusal is RedisFull", isinstance(refusal, RedisFull),
                  f"got {type(refusal).__name__}: {str(refusal)[:120]}")
    status, body = 0, {}
    for i in range(REST_TRIES):
        status, body, _ = rest_submit(url, key, f"rest-when-full-{i}", prompt=PROMPT)
        if status != 202:
            break
        sub.ids.append(body["task_id"])   # taken: it must end final like the others
    outcome.refused[f"REST {status}"] += 1
    outcome.check("REST refusal is 503", status == 503, f"got {status} {str(body)[:120]}")
    evicted = int(dep.r.info("stats").get("evicted_keys", 0))
    outcome.check("nothing evicted", evicted == 0, f"{evicted} keys evicted")
    kept = dep.r.hlen(dep.keys.messages(POOL))
    outcome.check("every accepted message kept", kept == len(sub.ids), f"{kept} of {len(sub.ids)}")
    mem = dep.r.info("memory")
    settings = dep.settings
    assert settings is not None
    stop_at = refuse_at_bytes(int(mem["maxmemory"]), settings.redis_memory_refuse_ratio,
                              int(settings.redis_memory_reserve_mib * MIB)) or 0
    outcome.notes.append(f"Redis {dep.r.info('server')['redis_version']}: {len(sub.ids)} submits of 8 KB "
                         f"accepted before the refusal, at {int(mem['used_memory']) / MIB:.2f} of "
                         f"{int(mem['maxmemory']) / MIB:.2f} MiB (submits stop at {stop_at / MIB:.2f})")
    started = time.monotonic()
    worker = dep.worker("w0", concurrency=8)
    recovered = None
    while time.monotonic() - started < 90:
        if sub.one(len(sub.ids) + 1, max_tokens=8):
            recovered = time.monotonic() - started
            break
        time.sleep(0.5)
    outcome.recovery_s = recovered
    sub.refused.clear()     # the probes while draining are counted in outcome.refused above
    settle(dep, outcome, sub, timeout_s=120)
    return worker


def at_maxmemory(dep: Deployment, size: Size, outcome: Outcome, worker: Child) -> None:
    sub = Submitter(dep)
    sub.many(size.tasks * 5, max_tokens=SLOW_MAX_TOKENS)
    deadline = time.monotonic() + 30
    in_flight: list[str] = []
    while not in_flight and time.monotonic() < deadline:
        in_flight = dep.sim.calls()["in_flight"]   # the squeeze lands on calls in flight and a queue
        time.sleep(0.02)
    limit = int(dep.r.config_get("maxmemory")["maxmemory"])
    used = int(dep.r.info("memory")["used_memory"])
    dep.r.config_set("maxmemory", max(1, used - MIB))
    squeezed = time.monotonic()
    queued = dep.r.hlen(dep.keys.messages(POOL))
    time.sleep(AT_MAX_S / 2)
    refused = not sub.one(len(sub.ids), max_tokens=8)
    outcome.check("a submit at maxmemory is refused with RedisFull",
                  refused and any(r.startswith("RedisFull") for r in sub.refused), f"refusals: {dict(sub.refused)}")
    time.sleep(max(0.0, AT_MAX_S - (time.monotonic() - squeezed)))
    dep.r.config_set("maxmemory", limit)
    freed = time.monotonic()
    outcome.notes.append(f"maxmemory 1 MiB below what Redis used for {freed - squeezed:.1f} s, from "
                         f"{len(in_flight)}+ upstream calls in flight and {queued} tasks not acked")
    finals = settle(dep, outcome, sub, timeout_s=120)
    if finals.final_at:
        outcome.recovery_s = max(finals.final_at.values()) - freed
    outcome.check("the worker lived through it", worker.alive(), "the worker process exited")
