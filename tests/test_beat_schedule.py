"""Pure cron maths: validation, next/previous nominal times, periods, misfire plans."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from beat.schedule import (FIRE, MISFIRE, NOT_DUE, actual_ms, cron_period_s, deferred_retry_ms, first_nominal_ms,
                           iso_utc, latest_nominal_ms, next_nominal_ms, plan_fire, validate_cron)
from gateway_tasks.core.errors import CronError


def ms(text: str) -> int:
    """'2024-03-01T10:00:30' (UTC) -> epoch ms; a trailing .fff is allowed."""
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1000)


@pytest.mark.parametrize("expr,normal", [
    ("0 * * * *", "0 * * * *"),
    ("  */5   *  * * * ", "*/5 * * * *"),
    ("@hourly", "@hourly"),
    ("@DAILY", "@daily"),
    ("0 9 * * mon-fri", "0 9 * * mon-fri"),
    ("0 0 L * *", "0 0 L * *"),
])
def test_valid_expressions_are_normalised(expr, normal):
    assert validate_cron(expr) == normal


@pytest.mark.parametrize("expr,reason", [
    ("61 * * * *", "out of range"),
    ("* * *", "expected 5 fields"),
    ("* * * * * *", "expected 5 fields"),
    ("0 * * * * 5 2024", "expected 5 fields"),
    ("", "empty"),
    ("   ", "empty"),
    ("@reboot", "unknown alias"),
    ("R * * * *", "random (R)"),
    ("H/5 * * * *", "hashed (H)"),
    ("0 0 30 2 *", "never fires"),
    ("a b c d e", "a b c d e"),
    ("*/0 * * * *", "*/0"),
])
def test_malformed_expressions_raise_cron_error_naming_expression_and_reason(expr, reason):
    with pytest.raises(CronError) as info:
        validate_cron(expr)
    message = str(info.value)
    assert repr(expr) in message
    assert reason in message


def test_non_string_expression():
    with pytest.raises(CronError, match="expected a string"):
        validate_cron(["0", "*"])  # type: ignore[arg-type]


@pytest.mark.parametrize("expr,period_s", [
    ("* * * * *", 60),
    ("*/5 * * * *", 300),
    ("0,10 * * * *", 600),            # uneven gaps: the smallest counts
    ("0 * * * *", 3600),
    ("@hourly", 3600),
    ("0 9 * * 1-5", 86_400),          # weekdays: 1 day (3 over the weekend)
    ("@daily", 86_400),
    ("0 0 * * 0", 7 * 86_400),
    ("0 0 1 * *", 28 * 86_400),       # February
    ("0 0 1 1 *", 365 * 86_400),
])
def test_period_is_the_smallest_gap_between_fires(expr, period_s):
    assert cron_period_s(expr) == period_s


@pytest.mark.parametrize("expr,after,expected", [
    ("0 * * * *", "2024-03-01T10:00:00", "2024-03-01T11:00:00"),        # strictly after
    ("0 * * * *", "2024-03-01T09:59:59.999", "2024-03-01T10:00:00"),
    ("0 * * * *", "2024-03-01T10:00:00.001", "2024-03-01T11:00:00"),
    ("*/5 * * * *", "2024-03-01T10:02:00", "2024-03-01T10:05:00"),
    ("0 9 * * 1-5", "2024-03-01T09:00:00", "2024-03-04T09:00:00"),      # Friday -> Monday
    ("0 0 29 2 *", "2024-03-01T00:00:00", "2028-02-29T00:00:00"),
    ("0 0 * * *", "2024-12-31T23:59:00", "2025-01-01T00:00:00"),
])
def test_next_nominal(expr, after, expected):
    assert next_nominal_ms(expr, ms(after)) == ms(expected)


@pytest.mark.parametrize("expr,at,expected", [
    ("0 * * * *", "2024-03-01T10:00:00", "2024-03-01T10:00:00"),        # at or before
    ("0 * * * *", "2024-03-01T09:59:59.999", "2024-03-01T09:00:00"),
    ("0 * * * *", "2024-03-01T10:59:00", "2024-03-01T10:00:00"),
    ("*/5 * * * *", "2024-03-01T10:07:00", "2024-03-01T10:05:00"),
    ("0 9 * * 1-5", "2024-03-03T12:00:00", "2024-03-01T09:00:00"),      # Sunday -> Friday
])
def test_latest_nominal(expr, at, expected):
    assert latest_nominal_ms(expr, ms(at)) == ms(expected)


@pytest.mark.parametrize("offset_s,now,settled,expected", [
    (0, "2024-03-01T10:03:00", None, "2024-03-01T11:00:00"),
    (300, "2024-03-01T10:03:00", None, "2024-03-01T10:00:00"),   # 10:00 run is at 10:05, ahead
    (180, "2024-03-01T10:03:00", None, "2024-03-01T11:00:00"),   # 10:00 run was at 10:03: passed
    (300, "2024-03-01T10:03:00", "2024-03-01T10:00:00", "2024-03-01T11:00:00"),  # already settled
    (0, "2024-03-01T09:59:59", "2024-03-01T09:00:00", "2024-03-01T10:00:00"),
])
def test_first_nominal_of_a_new_registration(offset_s, now, settled, expected):
    settled_ms = ms(settled) if settled else None
    assert first_nominal_ms("0 * * * *", offset_s, ms(now), settled_ms) == ms(expected)


H = "0 * * * *"


@pytest.mark.parametrize("cron,pending,offset_s,now,grace_s,action,nominal,following,late_s,skipped", [
    # not yet: the actual time (nominal + offset) is ahead
    (H, "10:00:00", 30, "10:00:29", 600, NOT_DUE, "10:00:00", "10:00:00", -1, False),
    # on time, late, exactly at the grace, just beyond it
    (H, "10:00:00", 30, "10:00:30", 600, FIRE, "10:00:00", "11:00:00", 0, False),
    (H, "10:00:00", 30, "10:05:00", 600, FIRE, "10:00:00", "11:00:00", 270, False),
    (H, "10:00:00", 30, "10:10:30", 600, FIRE, "10:00:00", "11:00:00", 600, False),
    (H, "10:00:00", 30, "10:10:31", 600, MISFIRE, "10:00:00", "11:00:00", 601, False),
    # grace counts from the jittered time: a 599 s offset fired 2 s late is not a misfire
    (H, "10:00:00", 599, "10:10:01", 600, FIRE, "10:00:00", "11:00:00", 2, False),
    # outage over several runs: only the latest missed one fires, once
    (H, "10:00:00", 30, "12:03:00", 600, FIRE, "12:00:00", "13:00:00", 150, True),
    (H, "10:00:00", 30, "12:20:00", 600, MISFIRE, "12:00:00", "13:00:00", 1170, True),
    # the 12:00 run (at 12:00:30) is still ahead; 11:00's was 59 min ago: skip to 12:00
    (H, "10:00:00", 30, "12:00:10", 600, MISFIRE, "11:00:00", "12:00:00", 3580, True),
    # zero grace
    (H, "10:00:00", 0, "10:00:00", 0, FIRE, "10:00:00", "11:00:00", 0, False),
    (H, "10:00:00", 0, "10:00:01", 0, MISFIRE, "10:00:00", "11:00:00", 1, False),
    # a 5-minute cron after a 12-minute outage
    ("*/5 * * * *", "10:00:00", 10, "10:12:00", 600, FIRE, "10:10:00", "10:15:00", 110, True),
])
def test_plan_fire(cron, pending, offset_s, now, grace_s, action, nominal, following, late_s, skipped):
    day = "2024-03-01T"
    plan = plan_fire(cron, ms(day + pending), offset_s, ms(day + now), grace_s)
    assert plan.action == action
    assert plan.nominal_ms == ms(day + nominal)
    assert plan.next_nominal_ms == ms(day + following)
    assert plan.late_ms == late_s * 1000
    assert plan.skipped_earlier is skipped
    if action != NOT_DUE:
        assert actual_ms(plan.next_nominal_ms, offset_s) > ms(day + now)   # waits for the future


def test_iso_utc():
    assert iso_utc(ms("2024-03-01T10:07:31")) == "2024-03-01T10:07:31Z"
    assert iso_utc(ms("2024-03-01T10:07:31") + 250) == "2024-03-01T10:07:31.250Z"
    assert iso_utc(None) is None


@pytest.mark.parametrize("now,retry_after_s,next_fire,expected", [
    (1_000, 600.0, 3_600_000, 601_000),        # well before the next run
    (1_000, 0.25, 3_600_000, 1_250),           # fractions of a second kept (ms)
    (1_000, 3599.0, 3_600_000, None),          # exactly at the next run: that run supersedes it
    (1_000, 3600.0, 3_600_000, None),          # past it
    (1_000, None, 3_600_000, None),            # no advice given
    (1_000, 0.0, 3_600_000, None),
    (1_000, -5.0, 3_600_000, None),
    (1_000, 600.0, None, None),                # no next run known
])
def test_a_deferred_run_is_retried_only_before_the_next_run(now, retry_after_s, next_fire, expected):
    assert deferred_retry_ms(now, retry_after_s, next_fire) == expected
