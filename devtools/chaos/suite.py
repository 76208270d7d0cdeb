"""The fault suite: every fault module by its short name, run one after the other."""

from __future__ import annotations

import importlib
import logging
import time
import traceback
from typing import Callable, Sequence

from gateway_tasks.core.errors import ConfigError
from devtools.chaos.outcome import Outcome
from devtools.chaos.workload import Size

log = logging.getLogger(__name__)

# short name -> module (each defines run(size) -> Outcome, or runs(size) -> list[Outcome])
FAULTS = {
    "worker-kill": "devtools.chaos.worker_kill",
    "kill-points": "devtools.chaos.kill_points",
    "worker-pause": "devtools.chaos.worker_pause",
    "redis-restart": "devtools.chaos.redis_restart",
    "redis-down": "devtools.chaos.redis_down",
    "upstream-errors": "devtools.chaos.upstream_errors",
    "rate-limit-storm": "devtools.chaos.rate_limit_storm",
    "beat-leader": "devtools.chaos.beat_leader",
    "memory": "devtools.chaos.memory",
    "overload": "devtools.chaos.overload",
}


def select(names: Sequence[str] | None) -> list[str]:
    if not names:
        return list(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ConfigError(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    return list(names)


def run_fault(name: str, size: Size) -> list[Outcome]:
    module = importlib.import_module(FAULTS[name])
    try:
        if hasattr(module, "runs"):
            return list(module.runs(size))
        return [module.run(size)]
    except Exception as exc:  # noqa: BLE001 -- a broken run is a FAIL row, not a crash of the suite
        log.error("fault %s broke: %s", name, traceback.format_exc())
        return [Outcome(name, error=f"{type(exc).__name__}: {exc}")]


def run_suite(size: Size, names: Sequence[str] | None = None,
              progress: Callable[[str], None] = lambda line: None) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for name in select(names):
        started = time.monotonic()
        progress(f"chaos: {name} ...")
        got = run_fault(name, size)
        outcomes.extend(got)
        for o in got:
            progress(f"chaos: {o.fault}: {'PASS' if o.passed else 'FAIL ' + '; '.join(o.failures)} "
                     f"({time.monotonic() - started:.0f} s)")
    return outcomes
