"""Faults: the upstream answers 500, times out, or refuses connections, for a while.

Two workers run a batch submitted as the fault starts.  Transient failures are
requeued while the tier's retry budget lasts, then the task fails with a clear
``UpstreamError``; no task is sent more than its tier's ``max_retries`` + 1 times, none ends
later than its deadline (plus the time to notice), and every token and request
slot the bucket lent to a failed call comes back: the pool bucket is put at a
known level below capacity first, so its ledger -- level before + refill -
what the upstream really charged -- must match the level after.
"""

from __future__ import annotations

import threading

from devtools.chaos.counters import ledger_gap, read_level, set_level
from devtools.chaos.deployment import POOL, Deployment
from devtools.chaos.observe import Calls
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.simulator import SimConfig

MODES = {"error_500": "upstream 500s for {s:g} s",
         "timeout": "upstream timeouts for {s:g} s",
         "refused": "upstream connection refused for {s:g} s"}
POOL_TPM = 3_000          # 50 tokens/s of refill: the ledger stays below capacity for a minute
START_LEVEL = 300.0
CLIENT_TIMEOUT_S = 2.0
LATE_SLACK_S = 5.0


def runs(size: Size) -> list[Outcome]:
    return [run_mode(size, mode) for mode in MODES]


def check_ledger(dep: Deployment, outcome: Outcome, before, charged_tokens: float,  # noqa: ANN001
                 charged_requests: float) -> None:
    pool = dep.settings.pool(POOL)   # type: ignore[union-attr]
    after = read_level(dep.r, dep.keys, pool)
    if after.tokens >= pool.token_capacity * 0.98 or after.requests >= pool.request_capacity * 0.98:
        outcome.notes.append("bucket ledger not checked: the bucket refilled to capacity")
        return
    gap_t, gap_r = ledger_gap(before, after, pool, charged_tokens, charged_requests)
    outcome.check("tokens refunded (bucket ledger)", abs(gap_t) <= 2.0, f"gap {gap_t:+.1f} tokens")
    outcome.check("request slots refunded (bucket ledger)", abs(gap_r) <= 1.0, f"gap {gap_r:+.2f} requests")
    outcome.notes.append(f"bucket ledger gap {gap_t:+.1f} tokens, {gap_r:+.2f} requests")


def run_mode(size: Size, mode: str) -> Outcome:
    outcome = Outcome(MODES[mode].format(s=size.outage_s))
    sim = SimConfig(tpm=10_000_000, rpm=1_000_000, base_latency_ms=50)
    with Deployment(f"upstream-{mode}", sim, pool_tpm=POOL_TPM, pool_rpm=POOL_TPM,
                    pool_timeout_s=CLIENT_TIMEOUT_S) as dep:
        dep.gw.register_tenant("acme", "vip")
        for i in range(2):
            dep.worker(f"w{i}", concurrency=4)
        dep.wait_workers(2)
        before = set_level(dep.r, dep.keys, dep.settings.pool(POOL), START_LEVEL, START_LEVEL)  # type: ignore[union-attr]
        calls = Calls()
        back = threading.Event()
        if mode == "refused":
            dep.sim_down()
            threading.Timer(size.outage_s, lambda: (dep.sim_up(), back.set())).start()
        else:
            dep.sim.set_fault(mode, for_s=size.outage_s, hang_s=CLIENT_TIMEOUT_S * 3)
            back.set()
        deadline_s = size.outage_s + 20.0
        sub = Submitter(dep)
        sub.many(size.tasks, deadline_s=deadline_s)
        back.wait(size.outage_s + 30)
        finals = settle(dep, outcome, sub, timeout_s=deadline_s + 30, calls=calls)
        stats = dep.sim.stats()
        check_ledger(dep, outcome, before, stats["tokens_prompt"] + stats["tokens_completion"],
                     stats["requests_ok"])
        most = calls.max_attempts()
        allowed = dep.settings.tier("vip").max_retries + 1   # the task's retry budget, 429s included
        outcome.check(f"at most {allowed} upstream attempts a task", most <= allowed,
                      f"a task was sent {most} times")
        late = [t for t, at in finals.final_at.items()
                if at - sub.submitted_at[t] > deadline_s + LATE_SLACK_S]
        outcome.check("nothing ends past its deadline", not late, f"{len(late)} ended late")
        outcome.notes.append(f"most upstream attempts of one task: {most}")
    return outcome
