"""Cron time maths, pure: every function is given the times it needs (no clock).

Times are integer milliseconds since the epoch, UTC.  Vocabulary:

* nominal time: when the cron expression says the entry runs (10:00:00);
* actual time: nominal + the entry's jitter offset (10:07:31) -- the sorted
  set of due entries is scored by it;
* settled: a (entry, nominal) that was fired, or skipped on purpose.

Only UTC and standard 5-field expressions (or the @hourly/@daily/... aliases)
are accepted; croniter's seconds field and its random (R) / hashed (H) fields
are refused, the latter because they would differ between replicas (the
scheduler applies its own deterministic jitter instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache

from croniter import croniter
from croniter import CroniterError

from gateway_tasks.core.errors import CronError

MISFIRE_GRACE_S = 600

#: period = smallest gap between consecutive fires among the first
#: PERIOD_SAMPLE_FIRES fires after PERIOD_REFERENCE_MS (at most
#: PERIOD_HORIZON_MS later) -- fixed, so every replica computes the same value.
PERIOD_REFERENCE_MS = 1_704_067_200_000          # 2024-01-01T00:00:00Z
PERIOD_SAMPLE_FIRES = 1000
PERIOD_HORIZON_MS = 9 * 366 * 86_400_000
MIN_PERIOD_S = 60                                  # minute resolution

CRON_ALIASES = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
CRON_FIELDS = "minute hour day-of-month month day-of-week"

FIRE = "fire"          # fire this nominal time now
MISFIRE = "misfire"    # too late (beyond the grace): skip it, do not fire
NOT_DUE = "not_due"    # the pending nominal's actual time is still ahead


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, timezone.utc)


def _ms(value: datetime) -> int:
    return int(round(value.timestamp() * 1000))


def iso_utc(ms: int | None) -> str | None:
    """2024-01-01T10:07:31Z (milliseconds shown only when not zero)."""
    if ms is None:
        return None
    value = _dt(ms)
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += f".{value.microsecond // 1000:03d}"
    return text + "Z"


def validate_cron(expr: str) -> str:
    """The expression with whitespace normalised; CronError naming it and the reason."""
    if not isinstance(expr, str):
        raise CronError(f"malformed cron expression {expr!r}: expected a string")
    return _validate_cron(expr)


@lru_cache(maxsize=4096)
def _validate_cron(expr: str) -> str:
    text = " ".join(expr.split())
    if not text:
        raise CronError(f"malformed cron expression {expr!r}: it is empty; expected 5 fields "
                        f"({CRON_FIELDS}) such as '0 * * * *'")
    if text.startswith("@"):
        if text.lower() not in CRON_ALIASES:
            raise CronError(f"malformed cron expression {expr!r}: unknown alias; "
                            f"known: {', '.join(CRON_ALIASES)}")
        text = text.lower()
    else:
        fields = text.split(" ")
        if len(fields) != 5:
            raise CronError(f"malformed cron expression {expr!r}: expected 5 fields "
                            f"({CRON_FIELDS}), got {len(fields)}")
        for field in fields:
            for part in field.split(","):
                if part[:1].upper() in ("H", "R"):
                    raise CronError(f"malformed cron expression {expr!r}: hashed (H) and random (R) "
                                    "fields are not supported; the scheduler adds its own "
                                    "deterministic jitter")
    try:
        itr = croniter(text, _dt(PERIOD_REFERENCE_MS))
    except (CroniterError, ValueError, KeyError, TypeError) as exc:
        raise CronError(f"malformed cron expression {expr!r}: {exc}") from None
    try:
        itr.get_next(datetime)
    except (CroniterError, ValueError) as exc:
        raise CronError(f"cron expression {expr!r} never fires: {exc}") from None
    return text


@lru_cache(maxsize=65536)
def next_nominal_ms(cron: str, after_ms: int) -> int:
    """The first nominal time strictly after ``after_ms``."""
    found = _ms(croniter(cron, _dt(after_ms)).get_next(datetime))
    while found <= after_ms:      # defensive: croniter rounds to whole seconds
        found = _ms(croniter(cron, _dt(found)).get_next(datetime))
    return found


def latest_nominal_ms(cron: str, at_or_before_ms: int) -> int:
    """The last nominal time at or before ``at_or_before_ms``."""
    found = _ms(croniter(cron, _dt(at_or_before_ms + 1)).get_prev(datetime))
    while found > at_or_before_ms:
        found = _ms(croniter(cron, _dt(found)).get_prev(datetime))
    return found


@lru_cache(maxsize=4096)
def cron_period_s(cron: str) -> int:
    """The smallest gap (s) between two consecutive nominal times of ``cron``."""
    itr = croniter(cron, _dt(PERIOD_REFERENCE_MS))
    prev = _ms(itr.get_next(datetime))
    smallest: int | None = None
    for _ in range(PERIOD_SAMPLE_FIRES):
        try:
            cur = _ms(itr.get_next(datetime))
        except (CroniterError, ValueError):
            break
        gap = cur - prev
        smallest = gap if smallest is None else min(smallest, gap)
        if smallest <= MIN_PERIOD_S * 1000 or cur - PERIOD_REFERENCE_MS > PERIOD_HORIZON_MS:
            break
        prev = cur
    if smallest is None:
        raise CronError(f"cron expression {cron!r} fires at most once; a period is needed")
    return max(1, smallest // 1000)


HOUR_MS = 3_600_000


@lru_cache(maxsize=4096)
def fires_per_hour(cron: str) -> int:
    """The most nominal times of ``cron`` in one clock hour (UTC).  Every hour the
    expression fires in holds the same minutes (the minute field), so that is the count
    in the first such hour; the hours between count 0.  @hourly and coarser: 1."""
    itr = croniter(cron, _dt(PERIOD_REFERENCE_MS - 1000))
    first = _ms(itr.get_next(datetime))
    hour_end = (first // HOUR_MS + 1) * HOUR_MS
    count = 1
    while _ms(itr.get_next(datetime)) < hour_end:
        count += 1
    return count


def actual_ms(nominal_ms: int, offset_s: int) -> int:
    """When the entry really fires for a nominal time."""
    return nominal_ms + offset_s * 1000


def first_nominal_ms(cron: str, offset_s: int, now_ms: int, settled_ms: int | None = None) -> int:
    """The first nominal time a newly (re-)registered entry should fire for.

    That is the first nominal whose *actual* time is still ahead (so a free-tier
    entry registered at 10:03 with a 5-minute offset still fires its 10:00 run at
    10:05), and later than any nominal already settled by a previous definition
    of the same entry (so an update never re-fires a run).
    """
    nominal = next_nominal_ms(cron, now_ms - offset_s * 1000)
    if settled_ms is not None and nominal <= settled_ms:
        nominal = next_nominal_ms(cron, settled_ms)
    return nominal


@dataclass(frozen=True)
class FirePlan:
    """What one tick does with one due entry."""

    action: str            # FIRE, MISFIRE or NOT_DUE
    nominal_ms: int        # the nominal time settled by this step (fired or skipped)
    next_nominal_ms: int   # the nominal time the entry waits for afterwards
    late_ms: int           # now - actual time of nominal_ms (>= 0 unless NOT_DUE)
    skipped_earlier: bool  # older missed nominal times were passed over


def plan_fire(cron: str, pending_nominal_ms: int, offset_s: int, now_ms: int,
              misfire_grace_s: int = MISFIRE_GRACE_S) -> FirePlan:
    """Decide what to do with an entry waiting for ``pending_nominal_ms``.

    * Its actual time is ahead: NOT_DUE (nothing changes).
    * Otherwise take the *latest* nominal time whose actual time has passed
      (several are missed after a scheduler outage).  If it is late by at most
      the grace it fires, once; if later, it is skipped (MISFIRE).  Older missed
      nominal times are never fired.  Either way the entry then waits for the
      first nominal time whose actual time is in the future.

    Lateness is measured from the *actual* (jittered) time, not the nominal one:
    a free-tier entry with a 599 s offset that runs on time is not late.
    """
    offset_ms = offset_s * 1000
    if pending_nominal_ms + offset_ms > now_ms:
        return FirePlan(NOT_DUE, pending_nominal_ms, pending_nominal_ms,
                        now_ms - (pending_nominal_ms + offset_ms), False)
    following = next_nominal_ms(cron, pending_nominal_ms)
    if following + offset_ms > now_ms:            # the common case: only one is due
        latest = pending_nominal_ms
    else:
        latest = max(pending_nominal_ms, latest_nominal_ms(cron, now_ms - offset_ms))
        following = next_nominal_ms(cron, latest)
    late_ms = now_ms - (latest + offset_ms)
    action = FIRE if late_ms <= misfire_grace_s * 1000 else MISFIRE
    return FirePlan(action, latest, following, late_ms, latest != pending_nominal_ms)


def deferred_retry_ms(now_ms: int, retry_after_s: float | None, next_fire_ms: int | None) -> int | None:
    """When a run the load level deferred at ``now_ms`` is tried again: ``retry_after_s``
    later (the Deferred error's advice), provided that comes before the entry's next
    (jittered) fire time -- past it the next run supersedes this one, and None is returned.
    None too when no retry time was given or the entry has no next fire time."""
    if retry_after_s is None or retry_after_s <= 0 or next_fire_ms is None:
        return None
    at_ms = now_ms + int(round(retry_after_s * 1000))
    return at_ms if at_ms < next_fire_ms else None
