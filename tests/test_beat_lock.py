"""The beat leader lock: token-checked renew and release, expiry."""

from __future__ import annotations

import time

import pytest

from beat.lock import (BeatLock, follower_retry_s, leader_renew_s, lock_ttl_ms, renewal_slack_s,
                       takeover_within_s)
from gateway_tasks.core.keys import Keys


def test_one_holder_at_a_time(r, settings):
    key = Keys(settings.key_prefix).beat_lock
    a = BeatLock(r, key, ttl_ms=5000, token="a")
    b = BeatLock(r, key, ttl_ms=5000, token="b")
    assert a.acquire() and a.held
    assert not b.acquire() and not b.held
    assert a.acquire()                      # already ours: renews
    assert a.renew() and not b.renew()
    assert not b.release()                  # not b's to release
    assert a.owner() == "a"
    assert 0 < r.pttl(key) <= 5000
    assert a.release() and not a.held
    assert r.get(key) is None
    assert b.acquire() and b.owner() == "b"


def test_expired_lock_is_taken_over_and_old_holder_cannot_renew(r, settings):
    key = Keys(settings.key_prefix).beat_lock
    a = BeatLock(r, key, ttl_ms=150, token="a")
    b = BeatLock(r, key, ttl_ms=150, token="b")
    assert a.acquire()
    time.sleep(0.25)
    assert b.acquire()
    assert not a.renew() and not a.held
    assert not a.release()
    assert b.owner() == "b"


def test_default_token_is_unique_per_lock(r, settings):
    key = Keys(settings.key_prefix).beat_lock
    assert BeatLock(r, key, 1000).token != BeatLock(r, key, 1000).token


@pytest.mark.parametrize("tick_s, ttl_ms, renew_s, retry_s, slack_s, takeover_s", [
    (1.0, 1500, 0.5, 0.25, 1.0, 1.75),
    (0.2, 300, 0.1, 0.05, 0.2, 0.35),
    (10.0, 15000, 5.0, 2.5, 10.0, 17.5),
])
def test_lock_timing_in_ticks(tick_s, ttl_ms, renew_s, retry_s, slack_s, takeover_s):
    assert lock_ttl_ms(tick_s) == ttl_ms
    assert leader_renew_s(tick_s) == pytest.approx(renew_s)
    assert follower_retry_s(tick_s) == pytest.approx(retry_s)
    assert renewal_slack_s(tick_s) == pytest.approx(slack_s)     # a whole tick of stall tolerated
    assert takeover_within_s(tick_s) == pytest.approx(takeover_s)
    assert takeover_within_s(tick_s) < 2 * tick_s               # the fault suite's target
