"""Fault: 10x the pool's TPM offered for a while (``Size.overload_s``).

Three tenants (vip, normal, batch) offer ten times what the upstream admits.
Each tier's queue is capped (``queue_max_len`` = 100 here): the excess is
refused at submit with ``QueueFull`` (tail drop), the queues never grow past
their cap, Redis memory stays bounded, and every accepted request reaches a
final state -- completed, or ``DeadlineExceeded`` once it waited past its 30 s
deadline.
"""

from __future__ import annotations

import threading
import time

from devtools.chaos.deployment import POOL, Deployment, with_tier_changes
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.simulator import SimConfig

TPM = 60_000
OVERLOAD = 10
QUEUE_MAX_LEN = 100
MAX_TOKENS = 200
DEADLINE_S = 30.0
BURST_S = 2.0          # a small bucket: the overload is felt from the first second
TENANTS = (("acme", "vip"), ("bulk", "normal"), ("free", "batch"))


def run(size: Size) -> Outcome:
    outcome = Outcome(f"{OVERLOAD}x TPM offered for {size.overload_s:g} s, queue_max_len {QUEUE_MAX_LEN}")
    sim = SimConfig(tpm=TPM, rpm=10_000, burst_s=BURST_S, base_latency_ms=200)
    with Deployment("overload", sim, pool_tpm=TPM, pool_rpm=10_000, pool_burst_s=BURST_S) as dep:
        settings = with_tier_changes(dep.settings, queue_max_len=QUEUE_MAX_LEN)  # type: ignore[arg-type]
        dep.settings = settings
        dep.gw = type(dep.gw)(settings, client=dep.r)
        for tenant, tier in TENANTS:
            dep.gw.register_tenant(tenant, tier)
        for i in range(2):
            dep.worker(f"w{i}", concurrency=8)
        dep.wait_workers(2)
        subs = [Submitter(dep, tenant=t) for t, _ in TENANTS]
        est = dep.gw.estimate("acme", "chaos task 0", max_tokens=MAX_TOKENS).est_tokens
        per_s = OVERLOAD * TPM / 60.0 / est              # tasks per second offered, all tenants
        stop = threading.Event()
        threads = [s.background(stop, len(subs) / per_s, max_tokens=MAX_TOKENS, deadline_s=DEADLINE_S)
                   for s in subs]
        peak_depth = {tier: 0 for _, tier in TENANTS}
        peak_mem = 0
        started = time.monotonic()
        while time.monotonic() - started < size.overload_s:
            depth = {tier: dep.r.zcard(dep.keys.index(POOL, tier)) for tier in peak_depth}
            for tier in peak_depth:
                peak_depth[tier] = max(peak_depth[tier], depth.get(tier, 0))
            peak_mem = max(peak_mem, int(dep.r.info("memory")["used_memory"]))
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        offered_s = time.monotonic() - started
        merged = Submitter(dep)
        for s in subs:
            merged.ids += s.ids
            merged.refused.update(s.refused)
            merged.submitted_at.update(s.submitted_at)
        settle(dep, outcome, merged, timeout_s=DEADLINE_S + 90)
        over = {t: d for t, d in peak_depth.items() if d > QUEUE_MAX_LEN}
        outcome.check("queues bounded by queue_max_len", not over, f"peaks {peak_depth}")
        offered = len(merged.ids) + sum(merged.refused.values())
        stats = dep.sim.stats()
        outcome.notes.append(
            f"offered {offered / offered_s:.1f} tasks/s ({offered} in {offered_s:.0f} s, ~{est} tokens each = "
            f"{offered * est / offered_s * 60 / TPM:.1f}x TPM); peak depth {peak_depth}; "
            f"peak Redis memory {peak_mem / 2**20:.1f} MiB; upstream 429s {stats['requests_429']}")
    return outcome
