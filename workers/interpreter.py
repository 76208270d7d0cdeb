"""The worker process's interpreter: its GIL switch interval and its garbage collector.

A worker runs its tasks on threads of one process, so two interpreter-wide pauses
sit in every task's latency:

* **The GIL switch interval** (``Settings.worker_switch_interval_ms``).  A thread
  whose upstream reply has arrived must take the GIL back, several times per call,
  and while other threads run Python each wait lasts up to the switch interval.
  CPython's 5 ms is tuned for throughput; ``gateway-dev cron-bench --storm
  --compare-switch MS`` measures another value side by side.
* **Full collections** (``Settings.worker_gc_freeze``).  A worker holds ~150k
  objects once the openai SDK, Celery and its pools are loaded, and CPython's
  generation-2 collection walks all of them with every thread stopped: measured
  in the cron storm at 85-224 ms a pause (2 cores shared with the storm), one as
  the storm began and another as it ended in each worker.  Those objects live as
  long as the process, so once the worker is ready they are moved out of the
  collector's reach (``gc.freeze()``, after a last collection so no garbage is
  kept); later full collections walk only what was created since.

Both are applied in the worker's own process (``worker_init``, ``worker_ready``),
never at import: the producer, the REST API and the tests keep their own.
"""

from __future__ import annotations

import gc
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


def freeze_startup_objects() -> int:
    """Collect once, then move every object the collector tracks to its permanent
    generation (full collections skip them); how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        apply_switch_interval(settings_of(app).worker_switch_interval_ms)


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    # (Celery configures logging after worker_init: the figures are logged here)
    app = getattr(sender, "app", None)
    frozen = "off"
    if app is not None and settings_of(app).worker_gc_freeze:
        frozen = f"{freeze_startup_objects():,} startup objects frozen"
    log.info("worker GIL switch interval %.3g ms; garbage collector: %s", sys.getswitchinterval() * 1000.0,
             frozen)
