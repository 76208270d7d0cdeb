"""Faults: a 429 storm, with ``Retry-After`` and without any rate-limit header.

Every call is refused for a while.  A 429 drains the pool until Retry-After
(1 s when the upstream gives none) and requeues the task, counting against its
attempts: no task may be sent more than its tier's ``max_retries`` + 1 times, and one with a deadline ends by it.  Half the batch has a
deadline shorter than the storm.
"""

from __future__ import annotations

from devtools.chaos.deployment import Deployment
from devtools.chaos.observe import Calls
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.simulator import SimConfig

MODES = {"rate_limit": "429 storm for {s:g} s, Retry-After 1 s",
         "rate_limit_bare": "429 storm for {s:g} s, no Retry-After"}
LATE_SLACK_S = 5.0


def runs(size: Size) -> list[Outcome]:
    return [run_mode(size, mode) for mode in MODES]


def run_mode(size: Size, mode: str) -> Outcome:
    outcome = Outcome(MODES[mode].format(s=size.outage_s))
    with Deployment(f"storm-{mode}", SimConfig(base_latency_ms=50)) as dep:
        dep.gw.register_tenant("acme", "vip")
        for i in range(2):
            dep.worker(f"w{i}", concurrency=4)
        dep.wait_workers(2)
        dep.sim.set_fault(mode, for_s=size.outage_s, retry_after_s=1.0)
        sub = Submitter(dep)
        short = max(2.0, size.outage_s / 2)
        long = size.outage_s + 30.0
        half = size.tasks // 2
        short_ids = set(sub.many(half, deadline_s=short))
        sub.many(size.tasks - half, deadline_s=long)
        calls = Calls()
        finals = settle(dep, outcome, sub, timeout_s=long + 30, calls=calls)
        most = calls.max_attempts()
        allowed = dep.settings.tier("vip").max_retries + 1   # the task's retry budget, 429s included
        outcome.check(f"at most {allowed} upstream attempts a task", most <= allowed,
                      f"a task was sent {most} times")
        late = [t for t, at in finals.final_at.items()
                if at - sub.submitted_at[t] > (short if t in short_ids else long) + LATE_SLACK_S]
        outcome.check("nothing ends past its deadline", not late, f"{len(late)} ended late")
        stats = dep.sim.stats()
        outcome.notes.append(f"most upstream attempts of one task: {most}; "
                             f"{stats['requests_429']} x 429 answered")
    return outcome
