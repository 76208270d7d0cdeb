"""What one fault run measured (``Outcome``), and how it is judged.

* submitted: submits that returned success (a task id); ``refused`` counts the
  submits that raised, by reason -- the caller was told, nothing was promised;
* completed / failed (by reason): tasks that reached a final state;
* lost: submitted, never final by the end of the run (the target is always 0);
* duplicated: upstream calls served more than once for one task id (counted at
  the simulator) against ``allowed_duplicates`` -- the calls in flight at a kill;
* recovery_s: how long the fault's recovery took (what is measured is fault
  specific: re-dispatch after a kill, first dispatch after a Redis restart,
  leader takeover...) against ``recovery_target_s``;
* checks: named yes/no checks (counters back to zero, errors clear, ...).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    fault: str
    submitted: int = 0
    completed: int = 0
    failed: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    lost: int = 0
    duplicated: int = 0
    allowed_duplicates: int = 0
    recovery_s: float | None = None
    recovery_target_s: float | None = None
    recovery_what: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str = ""      # the run itself broke (an exception in the harness)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks[name] = bool(ok)
        if not ok and detail:
            self.notes.append(f"{name}: {detail}")
        return bool(ok)

    @property
    def correctness_failures(self) -> list[str]:
        """What went wrong apart from how long recovery took."""
        why = [f"check {name}" for name, ok in self.checks.items() if not ok]
        if self.error:
            why.append(f"error {self.error}")
        if self.lost:
            why.append(f"{self.lost} lost")
        if self.duplicated > self.allowed_duplicates:
            why.append(f"{self.duplicated} duplicated > {self.allowed_duplicates} in flight at the fault")
        if self.recovery_target_s is not None and self.recovery_s is None:
            why.append("no recovery seen")
        if self.completed + sum(self.failed.values()) + self.lost != self.submitted:
            why.append("accounting: completed + failed + lost != submitted")
        return why

    @property
    def timing_failures(self) -> list[str]:
        """Recovery slower than its target: a speed figure, judged by ``gateway-dev chaos``
        (not by the test suite, whose machines are shared and noisy)."""
        if self.recovery_target_s is not None and self.recovery_s is not None \
                and self.recovery_s > self.recovery_target_s:
            return [f"recovery {self.recovery_s:.2f} s > {self.recovery_target_s:g} s"]
        return []

    @property
    def failures(self) -> list[str]:
        """Why the row fails its target (empty: PASS)."""
        return self.correctness_failures + self.timing_failures

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "submitted": self.submitted, "completed": self.completed,
                "failed": dict(self.failed), "refused": dict(self.refused), "lost": self.lost,
                "duplicated": self.duplicated, "allowed_duplicates": self.allowed_duplicates,
                "recovery_s": self.recovery_s, "recovery_target_s": self.recovery_target_s,
                "recovery_what": self.recovery_what, "checks": dict(self.checks),
                "notes": list(self.notes), "error": self.error, "passed": self.passed,
                "failures": self.failures}
