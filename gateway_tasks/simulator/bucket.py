"""The simulator's rate-limit maths: a continuous-refill token bucket, a strict
sliding window, and OpenAI's duration format for the ``x-ratelimit-reset-*`` headers.

Pure and synchronous: the clock is injected (``time.monotonic`` by default),
so tests drive time by hand and the async simulator can check and debit a
bucket with no await in between.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from gateway_tasks.core.errors import ConfigError

Clock = Callable[[], float]

# Float slack when comparing a refilled level with a requested amount: after
# waiting exactly wait_s(amount), rounding must not make the take fail.
_EPSILON = 1e-9


class _Quota:
    """What both kinds of quota answer from their ``level`` and ``take``."""

    @property
    def level(self) -> float:
        raise NotImplementedError

    def take(self, amount: float) -> None:
        raise NotImplementedError

    def remaining(self) -> int:
        """Whole units available now, never negative (for headers)."""
        return max(0, math.floor(self.level + _EPSILON))

    def can_take(self, amount: float) -> bool:
        return self.level + _EPSILON >= amount

    def try_take(self, amount: float) -> bool:
        """Debit ``amount`` if it is available now; say whether it was."""
        if not self.can_take(amount):
            return False
        self.take(amount)
        return True


class TokenBucket(_Quota):
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


class SlidingWindow(_Quota):
    """At most ``limit`` units charged in any ``window_s`` seconds: a strict upstream's
    per-minute quota (``SimConfig.window = "strict"``).

    Each charge is kept with its time and counts until ``window_s`` after it; nothing is
    given back (``give`` is a no-op: a strict upstream keeps what it charged at admission).
    The same interface as ``TokenBucket``, so ``Simulator`` uses either: ``level`` is what
    the window has left, ``wait_s`` the exact time until an amount fits (the oldest charges
    expire), ``reset_s`` the time until the window is empty.
    """

    def __init__(self, limit: float, window_s: float = 60.0, clock: Clock = time.monotonic) -> None:
        if not limit > 0:
            raise ConfigError(f"window limit={limit!r} is invalid; expected > 0")
        self.capacity = float(limit)
        self.window_s = float(window_s)
        self._clock = clock
        self._charges: deque[tuple[float, float]] = deque()
        self._used = 0.0
        self.wasted = 0.0   # (a window wastes nothing it could count: kept for the stats' shape)

    def _expire(self) -> float:
        now_s = self._clock()
        while self._charges and self._charges[0][0] + self.window_s <= now_s:
            self._used -= self._charges.popleft()[1]
        if not self._charges:
            self._used = 0.0
        return now_s

    @property
    def level(self) -> float:
        self._expire()
        return self.capacity - self._used

    def take(self, amount: float) -> None:
        now_s = self._expire()
        self._charges.append((now_s, float(amount)))
        self._used += amount

    def give(self, amount: float) -> None:
        """Nothing: what a strict window charged stays charged until it expires."""

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` fits (inf if it exceeds the limit)."""
        if amount > self.capacity + _EPSILON:
            return math.inf
        now_s = self._expire()
        excess = self._used + amount - self.capacity
        if excess <= _EPSILON:
            return 0.0
        freed = 0.0
        for at_s, charged in self._charges:
            freed += charged
            if freed + _EPSILON >= excess:
                return max(0.0, at_s + self.window_s - now_s)
        return self.window_s   # (not reached: the charges sum to _used)

    def reset_s(self) -> float:
        now_s = self._expire()
        return max(0.0, self._charges[-1][0] + self.window_s - now_s) if self._charges else 0.0

    def fill(self) -> None:
        self._charges.clear()
        self._used = 0.0
        self.wasted = 0.0
