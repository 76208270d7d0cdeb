"""Fault: a worker paused (SIGSTOP) past its lease while its upstream calls run,
then resumed (SIGCONT).

Its tasks' leases expire, a survivor restores and runs them again (recovery:
re-dispatch after the pause, target 10 s).  When the paused worker wakes it
finishes the calls it had started: each such late finish must be detected
(release.lua sees another dispatch's token: ``stale_releases``), counted as a
duplicated upstream call -- allowed only for the calls in flight at the pause
-- and must not break the result's idempotency (one final result per task id)
nor leave a counter behind.
"""

from __future__ import annotations

import os
import signal
import time

from gateway_tasks.core.stats import STALE_RELEASES
from devtools.chaos.deployment import POOL, Deployment
from devtools.chaos.observe import Calls, final_ids, in_flight_at, started_pid
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.simulator import SimConfig

NAME = "worker SIGSTOP past its lease, then SIGCONT"
TARGET_S = 10.0


def run(size: Size) -> Outcome:
    outcome = Outcome(NAME, recovery_target_s=TARGET_S,
                      recovery_what="slowest re-dispatch of the paused worker's tasks after the pause")
    with Deployment("worker-pause", SimConfig(base_latency_ms=6_000)) as dep:
        dep.gw.register_tenant("acme", "vip")
        # the survivor is started first and held stopped until the pause: a worker's start
        # takes seconds (more than a 6 s call on a loaded machine), and a survivor started
        # after the sighting let the paused worker's calls finish before the pause (CI: none
        # held).  Stopped before any work is queued, it holds nothing meanwhile.
        survivor = dep.worker("survivor", concurrency=4)
        dep.wait_workers(1)
        os.kill(survivor.process.pid, signal.SIGSTOP)   # type: ignore[union-attr]
        paused = dep.worker("paused", concurrency=4)
        dep.wait_workers(1)                             # the stopped survivor answers no ping
        sub = Submitter(dep)
        sub.many(4)
        victims: set[str] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            in_flight = set(dep.sim.calls()["in_flight"])
            victims = {t for t in sub.ids if t in in_flight and started_pid(dep.gw.app, t) == paused.process.pid}  # type: ignore[union-attr]
            # all of them: the survivor is stopped, so the paused worker takes every task, and a
            # call it has not sent yet at the pause (past its lease check, the request not yet
            # at the upstream) is sent after SIGCONT -- a repeat the pause's snapshot cannot
            # count as in flight (CI: 4 repeated, 3 counted, when this waited for 2)
            if len(victims) == len(sub.ids):
                break
            time.sleep(0.05)
        pause_ms = dep.redis_now_ms()
        os.kill(paused.process.pid, signal.SIGSTOP)   # type: ignore[union-attr]
        os.kill(survivor.process.pid, signal.SIGCONT)  # type: ignore[union-attr]
        # the victims are the paused worker's calls the upstream has at the pause -- read
        # after it, not from the sighting above: a call the worker sent meanwhile is in
        # flight too and may finish twice
        at_pause = in_flight_at(dep.sim.calls(), final_ids(dep.gw.app, sub.ids))
        victims = {t for t in at_pause
                   if t in victims or started_pid(dep.gw.app, t) == paused.process.pid}  # type: ignore[union-attr]
        time.sleep(2 * dep.settings.lease_s + 2)      # type: ignore[union-attr]  # swept, run again
        sub.many(max(2, size.tasks // 2))
        os.kill(paused.process.pid, signal.SIGCONT)   # type: ignore[union-attr]
        calls = Calls()
        finals = settle(dep, outcome, sub, timeout_s=90, calls=calls)
        outcome.allowed_duplicates = len(victims)
        stale = int(dep.r.hget(dep.keys.stats(POOL), STALE_RELEASES) or 0)
        outcome.check("every late finish detected (stale_releases)", stale >= calls.duplicated(victims),
                      f"{stale} detected, {calls.duplicated(victims)} duplicated")
        outcome.check("paused worker's tasks were held", bool(victims), "none held at the pause")
        delays = [(finals.results[t]["timing"]["dispatched_ms"] - pause_ms) / 1000.0
                  for t in victims if t in finals.results]
        outcome.recovery_s = max(delays) if delays else None
        outcome.notes.append(f"{len(victims)} calls in flight at the pause, {stale} late finishes detected")
        survivor.stop()
    return outcome
