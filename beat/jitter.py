"""Deterministic per-entry jitter: the same offset on every replica and restart.

A cron entry of tenant T named K fires ``offset_s`` seconds after each of its
nominal cron times, where::

    offset_s = int(sha256(f"{T}:{K}").hexdigest(), 16) % window_s

``window_s`` is the tenant tier's ``jitter_window_s`` (enterprise 0 s, pro
120 s, free 600 s by default), capped at the cron's period (the smallest gap
between two consecutive nominal times).  The cap makes every offset strictly
smaller than the period, so the jittered run of one nominal time always
happens before the next nominal time: a ``*/5 * * * *`` entry of a free tenant
gets an offset in [0, 300) s, not [0, 600) s, and still runs every 5 minutes.

Pure functions only: no clock, no Redis.
"""

from __future__ import annotations

import hashlib


def jitter_hash(tenant_id: str, task_id: str) -> int:
    """The 256-bit integer the offset is taken from."""
    return int(hashlib.sha256(f"{tenant_id}:{task_id}".encode("utf-8")).hexdigest(), 16)


def effective_window_s(window_s: int, period_s: int | None = None) -> int:
    """The tier window capped at the cron period (offsets are < this value)."""
    window = max(0, int(window_s))
    if period_s is not None:
        window = min(window, max(0, int(period_s)))
    return window


def jitter_offset_s(tenant_id: str, task_id: str, window_s: int,
                    period_s: int | None = None) -> int:
    """Seconds between an entry's nominal and actual fire times, in [0, window)."""
    window = effective_window_s(window_s, period_s)
    if window <= 0:
        return 0
    return jitter_hash(tenant_id, task_id) % window
