"""Faults: the beat leader is SIGKILLed, or paused (SIGSTOP) longer than its lock's
TTL and then resumed (SIGCONT).

Two beat replicas run tenant crons; the leader is the process named in the
lock.  The follower must take the lock within 2 ticks of the fault (recovery
time), the paused leader must step down when it wakes, and -- at full size,
where the fault is timed two seconds before a minute boundary with crons due
at it -- every cron fires exactly once for that boundary (no double fire, none
missed) and its task runs once (counted at the simulator).
"""

from __future__ import annotations

import os
import signal
import time

from gateway_tasks.core.stats import CRON_DUPLICATE, CRON_FIRED
from devtools.chaos.deployment import Deployment
from devtools.chaos.observe import Calls, wait_final
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size
from gateway_tasks.simulator import SimConfig
from beat.api import register_cron

TICK_S = 1.0
CRONS = 5
HOWS = {"kill": "beat leader SIGKILL", "stop": "beat leader SIGSTOP past lock TTL, SIGCONT"}


def runs(size: Size) -> list[Outcome]:
    return [run_one(size, how) for how in HOWS]


def holder_pid(dep: Deployment) -> int | None:
    raw = dep.r.get(dep.keys.beat_lock)
    if raw is None:
        return None
    try:
        return int(raw.decode().split(":")[1])
    except (IndexError, ValueError):
        return None


def wait_second(dep: Deployment, second: int) -> None:
    """Sleep until the Redis clock's second-of-minute is ``second``."""
    while True:
        now_s = dep.redis_now_ms() / 1000.0
        wait = (second - now_s % 60) % 60
        if wait < 0.05 or wait > 59.9:
            return
        time.sleep(min(wait, 0.5))


def run_one(size: Size, how: str) -> Outcome:
    outcome = Outcome(HOWS[how], recovery_target_s=2 * TICK_S,
                      recovery_what="the follower holds the lock, after the fault")
    with Deployment(f"beat-{how}", SimConfig(base_latency_ms=50)) as dep:
        dep.gw.register_tenant("acme", "vip")            # vip: jitter window 0 s
        for i in range(CRONS):
            register_cron(dep.settings, dep.r, "acme", f"every-minute-{i}", "* * * * *",  # type: ignore[arg-type]
                          {"messages": [{"role": "user", "content": f"cron {i}"}], "max_tokens": 5})
        dep.worker("w0")
        beats = [dep.beat(f"beat{i}") for i in range(2)]
        dep.wait_workers(1)
        deadline = time.monotonic() + 30
        while holder_pid(dep) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = {b.process.pid: b for b in beats}   # type: ignore[union-attr]
        leader = pids.get(holder_pid(dep) or -1)
        if leader is None:
            outcome.check("a beat holds the lock", False, "no beat process holds it")
            return outcome
        if size.beat_fire:
            wait_second(dep, 58)                         # 2 s before a minute boundary
        fired_before = int(dep.r.hget(dep.keys.cron_stats, CRON_FIRED) or 0)
        boundary_ms = (dep.redis_now_ms() // 60_000 + 1) * 60_000
        fault_at = time.monotonic()
        os.kill(leader.process.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)  # type: ignore[union-attr]
        takeover = None
        while time.monotonic() - fault_at < 15:
            pid = holder_pid(dep)
            if pid is not None and pid != leader.process.pid:   # type: ignore[union-attr]
                takeover = time.monotonic() - fault_at
                break
            time.sleep(0.02)
        outcome.recovery_s = takeover
        if how == "stop":
            time.sleep(max(0.0, 2 * 2 * TICK_S - (time.monotonic() - fault_at)))  # past the TTL
            os.kill(leader.process.pid, signal.SIGCONT)   # type: ignore[union-attr]
            time.sleep(3 * TICK_S)
            outcome.check("the woken leader stepped down", holder_pid(dep) != leader.process.pid)  # type: ignore[union-attr]
        if size.beat_fire:
            while dep.redis_now_ms() < boundary_ms + 6_000:
                time.sleep(0.2)
            fired = int(dep.r.hget(dep.keys.cron_stats, CRON_FIRED) or 0) - fired_before
            dups = int(dep.r.hget(dep.keys.cron_stats, CRON_DUPLICATE) or 0)
            outcome.check(f"each of {CRONS} crons fired once at the boundary", fired == CRONS,
                          f"{fired} fires")
            outcome.check("no double fire", dups == 0, f"{dups} duplicates seen by the engine")
            calls = Calls().add(dep.sim.calls())
            ids = list(calls.served)
            finals = wait_final(dep.gw.app, ids, 30)
            outcome.submitted = len(ids)
            finals.apply(outcome)
            outcome.duplicated = calls.duplicated()
        else:
            outcome.notes.append("fires not checked at this size (no minute boundary waited for)")
    return outcome
