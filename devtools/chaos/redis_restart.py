"""Fault: Redis restarts (SHUTDOWN, then SIGKILL) with AOF everysec, during submits
and dispatch.

Two workers, one beat and the REST API run while a submitter sends a task every
0.1 s; Redis goes away for 2 s and comes back on the same port with its AOF.
Submits during the outage are refused (counted, not lost: the caller was told).
Workers, beat and the API must reconnect by themselves: dispatch resumes (the
recovery time is the first dispatch after Redis is back), beat holds its lock
again, the API answers 202 again, and every task submitted with success ends.
"""

from __future__ import annotations

import threading
import time

from devtools.chaos.deployment import Deployment
from devtools.chaos.observe import Calls, final_ids, in_flight_at
from devtools.chaos.outcome import Outcome
from devtools.chaos.redis_down import rest_submit
from devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.simulator import SimConfig

NAME = "Redis restart ({how}, AOF everysec) during submits + dispatch"
DOWN_S = 2.0
TARGET_S = 10.0


HOWS = ("shutdown", "kill")


def runs(size: Size) -> list[Outcome]:
    return [run_one(size, how) for how in HOWS]


def run_one(size: Size, how: str) -> Outcome:
    outcome = Outcome(NAME.format(how="SHUTDOWN" if how == "shutdown" else "SIGKILL"),
                      recovery_target_s=TARGET_S, recovery_what="first dispatch after Redis is back")
    with Deployment(f"redis-{how}", SimConfig(base_latency_ms=400)) as dep:
        key = dep.gw.register_tenant("acme", "vip")
        _api, url = dep.api()
        for i in range(2):
            dep.worker(f"w{i}", concurrency=4)
        dep.beat("beat0")
        dep.wait_workers(2)
        sub = Submitter(dep)
        stop = threading.Event()
        thread = sub.background(stop, 0.1)
        time.sleep(max(2.0, size.outage_s / 2))
        done = final_ids(dep.gw.app, list(sub.ids))
        in_flight = in_flight_at(dep.sim.calls(), done)
        dep.redis_down(how)
        time.sleep(DOWN_S)
        dep.redis_up()
        up_ms = dep.redis_now_ms()
        up_at = time.monotonic()
        time.sleep(max(3.0, size.outage_s / 2))
        stop.set()
        thread.join(timeout=30)
        api_ok = any(rest_submit(url, key, f"after restart {i}", timeout_s=10)[0] == 202 for i in range(20))
        outcome.check("API answers 202 after the restart", api_ok)
        lock_deadline = up_at + 15
        while dep.r.get(dep.keys.beat_lock) is None and time.monotonic() < lock_deadline:
            time.sleep(0.2)
        outcome.check("beat holds its lock again", dep.r.get(dep.keys.beat_lock) is not None)
        finals = settle(dep, outcome, sub, timeout_s=120, calls=Calls())
        outcome.allowed_duplicates = len(in_flight)
        outcome.check("no task failed because of the restart", not outcome.failed,
                      f"failed: {dict(outcome.failed)}")
        after = [r["timing"]["dispatched_ms"] for r in finals.results.values()
                 if r["timing"]["dispatched_ms"] and r["timing"]["dispatched_ms"] >= up_ms]
        outcome.recovery_s = (min(after) - up_ms) / 1000.0 if after else None
        replies: list = []
        for _ in range(10):     # this process's own pooled broker connection may be stale once
            try:
                replies = dep.gw.app.control.ping(timeout=1.0) or []   # type: ignore[union-attr]
            except Exception:  # noqa: BLE001
                replies = []
            if len(replies) >= 2:
                break
        outcome.check("both workers answer after the restart", len(replies) >= 2, f"{len(replies)} answered")
        outcome.notes.append(f"{len(in_flight)} calls in flight at the restart")
    return outcome
