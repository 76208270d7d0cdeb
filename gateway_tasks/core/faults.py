"""Test-only fault injection: a worker that SIGKILLs itself at a named step.

``GATEWAY_FAULT_KILL_AT=after_pick`` (or a comma-separated list of points)
makes the worker process kill -9 itself the first time it reaches that point,
so `gateway-dev chaos` can crash a worker between every pair of steps of a task's
life -- pick, upstream call, settle, ack -- and check that nothing is lost and
no counter leaks.  The variable is read once, at import; unset (production),
``kill_point`` is one test of an empty frozenset.
"""

from __future__ import annotations

import os
import signal

from gateway_tasks.core.errors import ConfigError

KILL_AT_ENV = "GATEWAY_FAULT_KILL_AT"
AFTER_PICK = "after_pick"          # pick.lua took the task (debited, leased); nothing ran yet
AFTER_UPSTREAM = "after_upstream"  # the upstream answered; the bucket is not settled
AFTER_SETTLE = "after_settle"      # settled and synced; the result is not stored, not acked
AFTER_ACK = "after_ack"            # release.lua acked it; the worker dies before the next pick
KILL_POINTS = (AFTER_PICK, AFTER_UPSTREAM, AFTER_SETTLE, AFTER_ACK)


def parse_kill_points(value: str) -> frozenset[str]:
    """The points named in GATEWAY_FAULT_KILL_AT; ConfigError for an unknown one."""
    points = frozenset(p.strip() for p in value.split(",") if p.strip())
    unknown = points - set(KILL_POINTS)
    if unknown:
        raise ConfigError(f"{KILL_AT_ENV}={value!r}: unknown kill point(s) {sorted(unknown)}; "
                          f"expected some of {', '.join(KILL_POINTS)}")
    return points


_KILL_AT = parse_kill_points(os.environ.get(KILL_AT_ENV, ""))


def kill_point(point: str) -> None:
    """SIGKILL this process if GATEWAY_FAULT_KILL_AT names ``point`` (no-op when unset)."""
    if _KILL_AT and point in _KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
