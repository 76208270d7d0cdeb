"""Fault: kill -9 between every pair of steps of a task -- pick, upstream call,
settle, ack -- with the worker's own fault-injection point
(``GATEWAY_FAULT_KILL_AT``, gateway_tasks/core/faults.py).

For each point a doomed worker (killing itself the first time it gets there)
and a survivor share a small batch; after the death every task must end,
the killed worker's tasks within 10 s, with no counter left behind (tenant
in-flight, parked, dispatched and lease entries, queued messages, depth).
Only a kill after the upstream answered (after_upstream, after_settle) may
duplicate the call it interrupted.
"""

from __future__ import annotations

import time

from devtools.chaos.deployment import POOL, Deployment
from devtools.chaos.observe import Calls, final_ids, held_task_ids, in_flight_at, started_pid
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.simulator import SimConfig
from gateway_tasks.core.stats import FINISHED_NOT_ACKED
from gateway_tasks.core.faults import KILL_POINTS

NAME = "kill -9 at each step ({points})"
TARGET_S = 10.0


def run(size: Size) -> Outcome:
    outcome = Outcome(NAME.format(points=", ".join(KILL_POINTS)), recovery_target_s=TARGET_S,
                      recovery_what="slowest re-dispatch of the dead worker's tasks after its death")
    worst: float | None = None
    for point in KILL_POINTS:
        with Deployment(f"kill-{point}", SimConfig(base_latency_ms=300)) as dep:
            dep.gw.register_tenant("acme", "vip")
            survivor = dep.worker("survivor", concurrency=1)
            dep.wait_workers(1)
            doomed = dep.worker("doomed", concurrency=4, kill_at=point)
            dep.wait_workers(2)
            sub = Submitter(dep)
            sub.many(max(4, size.tasks // 2))
            deadline = time.monotonic() + 30
            victims: set[str] = set()
            while doomed.alive() and time.monotonic() < deadline:
                held = held_task_ids(dep.r, dep.keys, POOL)
                victims = {t for t in held if started_pid(dep.gw.app, t) != survivor.process.pid}  # type: ignore[union-attr]
                time.sleep(0.02)
            death_ms = dep.redis_now_ms()
            held = held_task_ids(dep.r, dep.keys, POOL)     # the dead worker's are still recorded
            victims |= {t for t in held if started_pid(dep.gw.app, t) != survivor.process.pid}  # type: ignore[union-attr]
            if doomed.alive():
                outcome.notes.append(f"{point}: the doomed worker never reached its kill point")
                outcome.check(f"{point} reached", False)
            done = final_ids(dep.gw.app, sub.ids)
            allowed = in_flight_at(dep.sim.calls(), done) & victims
            part = Outcome(point)
            finals = settle(dep, part, sub, timeout_s=60, calls=Calls())
            outcome.submitted += part.submitted
            outcome.completed += part.completed
            outcome.failed.update(part.failed)
            outcome.lost += part.lost
            outcome.duplicated += part.duplicated
            outcome.allowed_duplicates += len(allowed)
            for name, ok in part.checks.items():
                outcome.check(f"{point}: {name}", ok)
            outcome.notes.extend(f"{point}: {n}" for n in part.notes)
            for t in victims - done:
                res = finals.results.get(t)
                if res and res["timing"]["dispatched_ms"]:
                    delay = (res["timing"]["dispatched_ms"] - death_ms) / 1000.0
                    worst = delay if worst is None else max(worst, delay)
            acked = int(dep.r.hget(dep.keys.stats(POOL), FINISHED_NOT_ACKED) or 0)
            outcome.notes.append(f"{point}: {len(victims - done)} held at the death, "
                                 f"{part.duplicated} calls duplicated, {acked} found finished and acked")
    outcome.recovery_s = worst
    return outcome
