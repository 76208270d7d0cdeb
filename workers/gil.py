"""The worker process's GIL switch interval (``Settings.worker_switch_interval_ms``).

A worker runs its tasks on threads of one process.  A thread whose upstream reply
has arrived must take the GIL back before it can read, parse and settle it, and
it does so several times per call (the response's headers, its body, the SDK's
parse); while other threads run Python (other tasks' parse, dispatch and settle)
each of those waits lasts up to the interpreter's switch interval before the
running thread is asked to let go.  CPython's 5 ms is tuned for throughput; a
shorter one trades a little of it for the latency of the threads that wait.

Set on ``worker_init`` (the worker's own process, before its consumer starts),
never at import: the producer, the REST API and the tests keep their own.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from celery.signals import worker_init, worker_ready

from gateway_tasks.core.celery_app import settings_of

log = logging.getLogger(__name__)


def apply_switch_interval(interval_ms: float) -> float:
    """Set this process's switch interval; the one it had, in ms."""
    before_ms = sys.getswitchinterval() * 1000.0
    sys.setswitchinterval(interval_ms / 1000.0)
    return before_ms


@worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        apply_switch_interval(settings_of(app).worker_switch_interval_ms)


@worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    # (Celery configures logging after worker_init: the figure is logged here)
    log.info("worker GIL switch interval %.3g ms", sys.getswitchinterval() * 1000.0)
