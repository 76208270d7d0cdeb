"""The beat leader lock: token-checked renew and release, expiry."""

from __future__ import annotations

import time

from beat.lock import BeatLock
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
