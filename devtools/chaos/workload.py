"""Submitting a fault run's tasks and judging what came of them: the parts every
fault shares (``Size``: the run's scale; ``submit``: submits that count refusals;
``settle``: wait for the tasks, count duplicates, check the counters)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from devtools.chaos.counters import describe, leftovers
from devtools.chaos.deployment import Deployment
from devtools.chaos.observe import Calls, Finals, reason_of, wait_final
from devtools.chaos.outcome import Outcome


@dataclass(frozen=True)
class Size:
    """How big a suite run is: ``FULL`` for `gateway-dev chaos`, ``QUICK`` inside `make test`."""

    name: str
    tasks: int            # tasks per fault
    kills: int            # SIGKILL rounds of the worker-kill fault
    outage_s: float       # connection refused / 500s / timeouts / 429 storms last this long
    overload_s: float     # the 10x TPM load lasts this long
    beat_fire: bool       # beat faults wait for a minute boundary to check fires
    memory_headroom_mib: int   # maxmemory is set this far above what Redis uses


FULL = Size("full", tasks=40, kills=3, outage_s=20.0, overload_s=120.0, beat_fire=True, memory_headroom_mib=32)
QUICK = Size("quick", tasks=8, kills=2, outage_s=4.0, overload_s=8.0, beat_fire=False, memory_headroom_mib=16)


@dataclass
class Submitter:
    """Submits through the Python API, recording ids and refusals (by reason)."""

    dep: Deployment
    tenant: str = "acme"
    ids: list[str] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    refusal_s: list[float] = field(default_factory=list)   # how long each refused submit took
    submitted_at: dict[str, float] = field(default_factory=dict)   # task id -> monotonic s

    def one(self, i: int, max_tokens: int = 8, deadline_s: float | None = None, tenant: str = "") -> bool:
        started = time.monotonic()
        try:
            h = self.dep.gw.submit(tenant or self.tenant, f"chaos task {i}", max_tokens=max_tokens,  # type: ignore[union-attr]
                                   deadline_s=deadline_s)
        except Exception as exc:  # noqa: BLE001 -- every refusal is counted by its reason
            self.refused[reason_of(exc)] += 1
            self.refusal_s.append(time.monotonic() - started)
            return False
        self.ids.append(h.id)
        self.submitted_at[h.id] = started
        return True

    def many(self, n: int, **kwargs: Any) -> list[str]:
        start = len(self.ids)
        for i in range(n):
            self.one(start + i, **kwargs)
        return self.ids[start:]

    def background(self, stop: threading.Event, every_s: float, **kwargs: Any) -> threading.Thread:
        """Submit one task every ``every_s`` until ``stop`` is set (a thread)."""
        def loop() -> None:
            i = 0
            next_at = time.monotonic()
            while not stop.is_set():
                self.one(10_000 + i, **kwargs)
                i += 1
                next_at += every_s          # a steady rate, whatever one submit takes
                stop.wait(max(0.0, next_at - time.monotonic()))
        thread = threading.Thread(target=loop, name="chaos-submitter", daemon=True)
        thread.start()
        return thread


def settle(dep: Deployment, outcome: Outcome, sub: Submitter, *, timeout_s: float = 120.0,
           calls: Calls | None = None, check_counters: bool = True) -> Finals:
    """Wait for every submitted task, fill the outcome's counts and duplicates, and check
    that the dispatch counters are back to empty."""
    outcome.submitted = len(sub.ids)
    outcome.refused.update(sub.refused)
    finals = wait_final(dep.gw.app, sub.ids, timeout_s)   # type: ignore[union-attr]
    finals.apply(outcome)
    calls = calls or Calls()
    calls.add(dep.sim.calls())
    outcome.duplicated = calls.duplicated(sub.ids)
    if check_counters:
        found = settled_leftovers(dep)
        outcome.check("counters back to zero", not found, f"left over: {describe(found)}")
    return finals


def settled_leftovers(dep: Deployment, timeout_s: float | None = None) -> dict[str, int]:
    """leftovers() once the last acks landed (a result is stored just before its ack; a dead
    holder's task is swept when its lease expires: wait up to two leases and a bit)."""
    if timeout_s is None:
        timeout_s = 2 * dep.settings.lease_s + 5.0   # type: ignore[union-attr]
    deadline = time.monotonic() + timeout_s
    while True:
        found = leftovers(dep.r, dep.keys, dep.settings)   # type: ignore[arg-type]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
