"""Upstream calls per task id (``GET /calls``): how often each gateway task reached
the simulator, so a fault run can count duplicated upstream calls.

Every chat request carrying ``X-Gateway-Task-Id`` counts one ``attempt``; one
the simulator admitted and started to serve counts one ``served`` (it did the
work and charged its quota), and is ``in_flight`` until its reply is sent.  A
task served more than once is a duplicated upstream call.
"""

from __future__ import annotations

from typing import Any


class CallCounter:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.attempts: dict[str, int] = {}
        self.served: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}

    def attempt(self, task_id: str) -> None:
        if task_id:
            self.attempts[task_id] = self.attempts.get(task_id, 0) + 1

    def start(self, task_id: str) -> None:
        if task_id:
            self.served[task_id] = self.served.get(task_id, 0) + 1
            self.in_flight[task_id] = self.in_flight.get(task_id, 0) + 1

    def finish(self, task_id: str) -> None:
        if task_id and task_id in self.in_flight:
            self.in_flight[task_id] -= 1
            if self.in_flight[task_id] <= 0:
                del self.in_flight[task_id]

    def snapshot(self) -> dict[str, Any]:
        return {"attempts": dict(self.attempts), "served": dict(self.served),
                "in_flight": sorted(self.in_flight),
                "duplicated": sum(n - 1 for n in self.served.values() if n > 1)}
