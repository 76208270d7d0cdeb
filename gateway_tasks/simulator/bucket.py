"""The simulator's rate-limit maths: a continuous-refill token bucket and
OpenAI's duration format for the ``x-ratelimit-reset-*`` headers.

Pure and synchronous: the clock is injected (``time.monotonic`` by default),
so tests drive time by hand and the async simulator can check and debit a
bucket with no await in between.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from gateway_tasks.core.errors import ConfigError

Clock = Callable[[], float]

# Float slack when comparing a refilled level with a requested amount: after
# waiting exactly wait_s(amount), rounding must not make the take fail.
_EPSILON = 1e-9


class TokenBucket:
    """A bucket of ``capacity`` units refilled continuously at ``refill_per_s``.

    It starts full.  ``take`` may push the level below zero (a debt paid back
    by refill), which is how charging actual usage after the fact behaves;
    ``give`` credits units back but never above capacity.  ``wasted`` counts
    the units that refill or ``give`` could not add because the bucket was
    full: quota nobody used (``fill`` starts the count again).
    """

    def __init__(self, capacity: float, refill_per_s: float,
                 clock: Clock = time.monotonic) -> None:
        if not capacity > 0:
            raise ConfigError(f"bucket capacity={capacity!r} is invalid; expected > 0")
        if not refill_per_s > 0:
            raise ConfigError(f"bucket refill_per_s={refill_per_s!r} is invalid; expected > 0")
        self.capacity = float(capacity)
        self.refill_per_s = float(refill_per_s)
        self._clock = clock
        self._level = self.capacity
        self._updated_s = clock()
        self.wasted = 0.0

    def _add(self, amount: float) -> None:
        """Credit ``amount``, capped at capacity; what the cap cuts off is wasted."""
        room = max(0.0, self.capacity - self._level)
        self.wasted += max(0.0, amount - room)
        self._level = min(self.capacity, self._level + amount)

    def _refill(self) -> None:
        now_s = self._clock()
        if now_s > self._updated_s:
            self._add((now_s - self._updated_s) * self.refill_per_s)
            self._updated_s = now_s

    @property
    def level(self) -> float:
        """Units available now (negative while in debt)."""
        self._refill()
        return self._level

    def remaining(self) -> int:
        """Whole units available now, never negative (for headers)."""
        return max(0, math.floor(self.level + _EPSILON))

    def can_take(self, amount: float) -> bool:
        return self.level + _EPSILON >= amount

    def try_take(self, amount: float) -> bool:
        """Debit ``amount`` if it is available now; say whether it was."""
        if not self.can_take(amount):
            return False
        self._level -= amount
        return True

    def take(self, amount: float) -> None:
        """Debit ``amount`` unconditionally (the level may go negative)."""
        self._refill()
        self._level -= amount

    def give(self, amount: float) -> None:
        """Credit ``amount`` back, capped at capacity."""
        self._refill()
        self._add(amount)

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` is available (inf if it exceeds capacity)."""
        if amount > self.capacity + _EPSILON:
            return math.inf
        missing = amount - self.level
        return max(0.0, missing / self.refill_per_s)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.level) / self.refill_per_s)

    def fill(self) -> None:
        """Refill to capacity at once (used when statistics are reset)."""
        self._level = self.capacity
        self._updated_s = self._clock()
        self.wasted = 0.0


def ceil_ms(seconds: float) -> int:
    """Whole milliseconds, rounded up after trimming float noise (``retry-after-ms``)."""
    if not seconds > 0:
        return 0
    if math.isinf(seconds):
        raise ValueError("an infinite duration cannot be formatted")
    return math.ceil(round(seconds * 1000.0, 6))


def format_duration(seconds: float) -> str:
    """OpenAI's (Go-style) duration text: "0s", "120ms", "1s", "1.5s", "6m0s", "1h0m0s".

    Rounded up to the millisecond, so a client that waits this long finds the
    capacity there.
    """
    ms = ceil_ms(seconds)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest_ms = divmod(ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    whole_s, frac_ms = divmod(rest_ms, 1000)
    secs = f"{whole_s}" if frac_ms == 0 else f"{whole_s}.{frac_ms:03d}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def format_seconds(seconds: float) -> str:
    """A ``Retry-After`` value: seconds rounded up to the ms, e.g. "13", "0.12"."""
    ms = ceil_ms(seconds)
    whole_s, frac_ms = divmod(ms, 1000)
    return f"{whole_s}" if frac_ms == 0 else f"{whole_s}.{frac_ms:03d}".rstrip("0")
