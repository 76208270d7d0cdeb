"""The one table `gateway-dev chaos` prints: a row per fault, then each row's notes."""

from __future__ import annotations

from typing import Sequence

from devtools.chaos.outcome import Outcome

COLUMNS = ("fault", "submitted", "completed", "failed (reason)", "lost", "dup calls / in flight",
           "recovery", "target")


def reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "0"


def recovery_cell(o: Outcome) -> str:
    if o.recovery_s is None:
        return "-" if o.recovery_target_s is None else "never"
    target = f" (< {o.recovery_target_s:g} s)" if o.recovery_target_s is not None else ""
    return f"{o.recovery_s:.2f} s{target}"


def row(o: Outcome) -> tuple[str, ...]:
    failed = reasons(o.failed)
    if o.refused:
        failed += f"; refused at submit: {reasons(o.refused)}"
    return (o.fault, str(o.submitted), str(o.completed), failed, str(o.lost),
            f"{o.duplicated} / {o.allowed_duplicates}", recovery_cell(o), "PASS" if o.passed else "FAIL")


def render(outcomes: Sequence[Outcome], markdown: bool = True) -> str:
    rows = [COLUMNS] + [row(o) for o in outcomes]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("---" for _ in COLUMNS) + "|")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    out = "\n".join(lines)
    notes = []
    for o in outcomes:
        checks = ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in o.checks.items())
        what = f"recovery = {o.recovery_what}; " if o.recovery_what else ""
        notes.append(f"* {o.fault}: {what}checks: {checks or 'none'}"
                     + (f"; {'; '.join(o.notes)}" if o.notes else "")
                     + (f"; FAIL because: {'; '.join(o.failures)}" if not o.passed else ""))
    return out + "\n\n" + "\n".join(notes)
