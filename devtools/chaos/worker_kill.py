"""Fault: kill -9 of a worker, repeatedly, mid-call and mid-pick, with 3 workers.

A slow upstream (3 s a call) keeps every worker busy.  Each round picks the
next worker, waits until it holds tasks, SIGKILLs it (no ack, no reject) and
starts a replacement, as a supervisor would.  The tasks it held are the ones
dispatched and not running in a live worker at the kill (Celery's STARTED meta
names the pid).  Target: every one of them running again elsewhere
within 10 s of the kill (its final dispatch time, Redis clock), none lost,
upstream calls duplicated only for the calls in flight at the kill, and no
counter left behind.
"""

from __future__ import annotations

import time

from devtools.chaos.deployment import POOL, Deployment
from devtools.chaos.observe import Calls, final_ids, held_task_ids, in_flight_at, started_pid
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.simulator import SimConfig

NAME = "worker SIGKILL x{kills}, 3 workers, mid-call/mid-pick"
TARGET_S = 10.0
WORKERS = 3


def run(size: Size) -> Outcome:
    outcome = Outcome(NAME.format(kills=size.kills), recovery_target_s=TARGET_S,
                      recovery_what="slowest re-dispatch of a killed worker's tasks after the kill")
    with Deployment("worker-kill", SimConfig(base_latency_ms=3_000)) as dep:
        dep.gw.register_tenant("acme", "vip")
        dep.gw.register_tenant("bulk", "normal")
        workers = [dep.worker(f"w{i}", concurrency=4) for i in range(WORKERS)]
        dep.wait_workers(WORKERS)
        sub = Submitter(dep)
        half = size.tasks // 2
        sub.many(size.tasks - half)
        sub.many(half, tenant="bulk")
        kills: list[tuple[int, set[str]]] = []   # (kill ms, the tasks the victim held)
        allowed: set[str] = set()
        for k in range(size.kills):
            victim_i = k % WORKERS
            victim = workers[victim_i]
            victims: set[str] = set()
            mid_call = k % 2 == 0     # even rounds: while its upstream calls run; odd: as it picks
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                held = held_task_ids(dep.r, dep.keys, POOL)
                live = {w.process.pid for w in workers if w is not victim and w.alive()}  # type: ignore[union-attr]
                victims = {t for t in held if started_pid(dep.gw.app, t) not in live}
                if victims and (not mid_call or victims & set(dep.sim.calls()["in_flight"])):
                    break
                time.sleep(0.05)
            kill_ms = dep.redis_now_ms()
            victim.kill()
            done = final_ids(dep.gw.app, sub.ids)
            allowed |= in_flight_at(dep.sim.calls(), done) & victims
            kills.append((kill_ms, victims - done))
            if k % 2:
                time.sleep(0.7)   # odd rounds: the replacement comes up while the survivors sweep
            workers[victim_i] = dep.worker(f"w{victim_i}r{k}", concurrency=4)
            if k + 1 < size.kills:
                sub.many(size.tasks // 2)        # more work for the next round
                time.sleep(2.0)
        calls = Calls()
        finals = settle(dep, outcome, sub, timeout_s=120, calls=calls)
        outcome.allowed_duplicates = len(allowed)
        worst = None
        held_n = 0
        for kill_ms, victims in kills:
            held_n += len(victims)
            for t in victims:
                res = finals.results.get(t)
                if res and res["timing"]["dispatched_ms"]:
                    delay = (res["timing"]["dispatched_ms"] - kill_ms) / 1000.0
                    worst = delay if worst is None else max(worst, delay)
        outcome.recovery_s = worst
        outcome.notes.append(f"{held_n} tasks held by the killed workers over {len(kills)} kills")
        outcome.check("killed workers held tasks", held_n > 0, "no kill caught a task")
        dup_results = len(finals.results) != len(set(r["task_id"] for r in finals.results.values()))
        outcome.check("one result per task id", not dup_results)
    return outcome
