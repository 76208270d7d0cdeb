"""Watching a fault run from outside: tasks' final states, which tasks a worker
holds, and the upstream calls per task id the simulator counted."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import redis
from celery.result import AsyncResult

from gateway_tasks.core.keys import Keys
from devtools.chaos.outcome import Outcome

FINAL = ("SUCCESS", "FAILURE", "REVOKED")


def reason_of(exc: Any) -> str:
    """A failure's reason as the table shows it: its error class and the start of its message."""
    text = re.sub(r"\d+(\.\d+)?", "N", str(exc).split(";")[0].split(":")[0])[:48].strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class Finals:
    results: dict[str, dict[str, Any]] = field(default_factory=dict)   # task id -> result document
    failed: dict[str, str] = field(default_factory=dict)               # task id -> reason
    pending: set[str] = field(default_factory=set)
    final_at: dict[str, float] = field(default_factory=dict)           # task id -> monotonic s seen final

    def apply(self, outcome: Outcome) -> None:
        outcome.completed += len(self.results)
        outcome.failed.update(Counter(self.failed.values()))
        outcome.lost += len(self.pending)


def wait_final(app: Any, task_ids: Iterable[str], timeout_s: float, poll_s: float = 0.25) -> Finals:
    """Poll every task until each is final or ``timeout_s`` passed (then it is pending).
    A Redis outage while polling is waited out, not fatal."""
    out = Finals(pending=set(task_ids))
    deadline = time.monotonic() + timeout_s
    while out.pending and time.monotonic() < deadline:
        for task_id in list(out.pending):
            result = AsyncResult(task_id, app=app)
            try:
                state = result.state
                if state not in FINAL:
                    continue
                value = result.result
            except (redis.RedisError, OSError):
                break
            out.pending.discard(task_id)
            out.final_at[task_id] = time.monotonic()
            if state == "SUCCESS" and isinstance(value, dict):
                out.results[task_id] = value
            else:
                out.failed[task_id] = reason_of(value)
        if out.pending:
            time.sleep(poll_s)
    return out


def started_pid(app: Any, task_id: str) -> int | None:
    """The pid a STARTED task runs in (Celery's task_track_started meta), else None."""
    result = AsyncResult(task_id, app=app)
    try:
        if result.state != "STARTED":
            return None
        info = result.info
    except (redis.RedisError, OSError):
        return None
    return int(info.get("pid")) if isinstance(info, dict) and info.get("pid") else None


def held_task_ids(client: redis.Redis, keys: Keys, pool: str) -> dict[str, str]:
    """Task id -> delivery tag of every dispatched, unacked task of a pool (from the
    dispatched hash and the messages the tags name)."""
    tags = [t.decode() for t in client.hkeys(keys.dispatched(pool))]
    if not tags:
        return {}
    out: dict[str, str] = {}
    for tag, raw in zip(tags, client.hmget(keys.messages(pool), tags)):
        if raw is None:
            continue
        headers = json.loads(raw).get("headers") or {}
        if headers.get("id"):
            out[str(headers["id"])] = tag
    return out


@dataclass
class Calls:
    """The simulator's /calls, summed over its restarts."""

    attempts: Counter = field(default_factory=Counter)
    served: Counter = field(default_factory=Counter)

    def add(self, snapshot: dict[str, Any]) -> "Calls":
        self.attempts.update(snapshot.get("attempts", {}))
        self.served.update(snapshot.get("served", {}))
        return self

    def duplicated(self, task_ids: Iterable[str] | None = None) -> int:
        ids = self.served.keys() if task_ids is None else task_ids
        return sum(max(0, self.served.get(t, 0) - 1) for t in ids)

    def max_attempts(self) -> int:
        return max(self.attempts.values(), default=0)


def in_flight_at(calls_snapshot: dict[str, Any], finals_done: set[str]) -> set[str]:
    """Tasks the upstream had served (or was serving) and that were not final: the calls
    a kill at this moment may duplicate."""
    return {t for t in calls_snapshot.get("served", {}) if t not in finals_done}


def final_ids(app: Any, task_ids: Iterable[str]) -> set[str]:
    done = set()
    for task_id in task_ids:
        try:
            if AsyncResult(task_id, app=app).state in FINAL:
                done.add(task_id)
        except (redis.RedisError, OSError):
            pass
    return done
