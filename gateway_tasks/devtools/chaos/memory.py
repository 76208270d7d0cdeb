"""Fault: Redis near its maxmemory (noeviction).

With no worker running, Redis gets a maxmemory a few MiB above what it uses and
a tenant submits 8 KB prompts until refused.  The refusal must be a clear
``RedisFull`` (Python) / 503 (REST), nothing may be evicted (``evicted_keys``
stays 0, every accepted message is still there), and once a worker starts --
maxmemory unchanged -- it must drain the queue by itself (picks, acks and
results still fit under the limit) until submits are accepted again.
"""

from __future__ import annotations

import time

from gateway_tasks.core.errors import RedisFull
from gateway_tasks.devtools.chaos.deployment import POOL, Deployment
from gateway_tasks.devtools.chaos.outcome import Outcome
from gateway_tasks.devtools.chaos.redis_down import rest_submit
from gateway_tasks.devtools.chaos.workload import Size, Submitter, settle
from gateway_tasks.devtools.simulator import SimConfig

NAME = "Redis near maxmemory (noeviction)"
PROMPT = "x " * 4000          # ~8 KB a message
MAX_SUBMITS = 5000


def run(size: Size) -> Outcome:
    outcome = Outcome(NAME, recovery_target_s=60.0,
                      recovery_what="submits accepted again, after a worker starts (maxmemory unchanged)")
    sim = SimConfig(tpm=100_000_000, rpm=1_000_000, base_latency_ms=20)
    with Deployment("memory", sim, pool_tpm=100_000_000, pool_rpm=1_000_000) as dep:
        key = dep.gw.register_tenant("acme", "vip")
        _api, url = dep.api()
        used = int(dep.r.info("memory")["used_memory"])
        dep.r.config_set("maxmemory", used + size.memory_headroom_mib * 2**20)
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
        status, body, _ = rest_submit(url, key, "rest-when-full", prompt=PROMPT)
        outcome.refused[f"REST {status}"] += 1
        outcome.check("REST refusal is 503", status == 503, f"got {status} {str(body)[:120]}")
        evicted = int(dep.r.info("stats").get("evicted_keys", 0))
        outcome.check("nothing evicted", evicted == 0, f"{evicted} keys evicted")
        kept = dep.r.hlen(dep.keys.messages(POOL))
        outcome.check("every accepted message kept", kept == len(sub.ids), f"{kept} of {len(sub.ids)}")
        mem = dep.r.info("memory")
        outcome.notes.append(f"{len(sub.ids)} submits of 8 KB accepted before the refusal, at "
                             f"{int(mem['used_memory']) / 2**20:.1f} of {int(mem['maxmemory']) / 2**20:.1f} MiB")
        started = time.monotonic()
        dep.worker("w0", concurrency=8)
        recovered = None
        while time.monotonic() - started < 90:
            if sub.one(len(sub.ids) + 1, max_tokens=8):
                recovered = time.monotonic() - started
                break
            time.sleep(0.5)
        outcome.recovery_s = recovered
        sub.refused.clear()     # the probes while draining are counted in outcome.refused above
        settle(dep, outcome, sub, timeout_s=120)
        dep.r.config_set("maxmemory", 0)
    return outcome
