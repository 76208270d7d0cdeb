"""The scheduler loop against the real Redis, with a virtual clock for cron time.

Cron time is virtual (``tick(now_ms=...)``); only the leader lock's TTL is real
time, and the HA tests assert on tick counts and ordering, never durations.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import pytest
import redis

from beat.engine import CronEngine
from beat.fire import run_key
from beat.store import CronSpec, CronStore
from gateway_tasks.core.keys import Keys
from gateway_tasks.tenants.registry import TenantRegistry

HOUR = 3_600_000
B = 1_709_290_800_000            # 2024-03-01T11:00:00Z, an hour boundary
PAYLOAD = {"messages": [{"role": "user", "content": "ping"}], "model": "gpt-4o-mini"}


class Recorder:
    """A fire function that records (entry id, nominal) and returns a task id."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[str, int]] = []
        self.entries = []
        self.lock = threading.Lock()
        self.fail = fail

    def __call__(self, entry, nominal_ms):
        with self.lock:
            self.calls.append((entry.entry_id, nominal_ms))
            self.entries.append(entry)
        if self.fail:
            raise RuntimeError("upstream down")
        return f"task-{len(self.calls)}"


@pytest.fixture
def tenants(r, settings):
    reg = TenantRegistry(r, settings)
    for tenant, tier in (("ent", "enterprise"), ("pro1", "pro"), ("free1", "free")):
        reg.register(tenant, tier)
    return reg


def make_engine(r, settings, fire, **kw):
    kw.setdefault("tick_interval_s", 5.0)
    return CronEngine(r, settings, fire, **kw)


def test_fires_at_the_jittered_time_once_and_reschedules(r, settings, tenants):
    store = CronStore(r, settings)
    e = store.add("free1", "digest", "0 * * * *", PAYLOAD, now=B - 10_000)
    actual = e.next_fire_ms
    assert e.next_nominal_ms == B and actual == B + e.jitter_offset_s * 1000
    fire = Recorder()
    eng = make_engine(r, settings, fire)
    assert eng.tick(now_ms=actual - 1).fired_count == 0
    report = eng.tick(now_ms=actual)
    assert report.leader and dict(report.statuses) == {"fired": 1}
    assert fire.calls == [("free1:digest", B)]
    assert fire.entries[0].payload == PAYLOAD and fire.entries[0].tier == "batch"
    assert eng.tick(now_ms=actual + 1000).fired_count == 0
    got = store.get("free1", "digest")
    assert got.next_nominal_ms == B + HOUR and got.next_fire_ms == actual + HOUR
    assert got.last_status == "fired" and got.last_task_id == "task-1"
    assert got.last_nominal_ms == B and got.last_fire_ms == actual and got.fired_count == 1
    k = Keys(settings.key_prefix)
    assert r.exists(k.cron_fired("free1:digest", B))
    assert 0 < r.pttl(k.cron_fired("free1:digest", B)) <= eng.idempotency_ttl_ms
    assert int(r.get(k.quota("free1", actual // HOUR))) == 1
    assert 0 < r.pttl(k.quota("free1", actual // HOUR)) <= 2 * HOUR
    assert r.hget(k.cron_stats, "fired") == b"1"


def test_tick_delay_is_time_to_next_due_capped_at_half_a_tick(r, settings, tenants):
    CronStore(r, settings).add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    eng = make_engine(r, settings, Recorder(), tick_interval_s=2.0)
    assert eng.tick(now_ms=B - 500).delay_s == pytest.approx(0.5)
    assert eng.tick(now_ms=B - 60_000).delay_s == 1.0     # the leader renews every half tick
    assert 0 < r.pttl(eng.keys.beat_lock) <= 3000         # to 1.5 ticks


def test_chunks_process_every_due_entry(r, settings, tenants):
    CronStore(r, settings).add_many([CronSpec("ent", f"c{i}", "0 * * * *", PAYLOAD) for i in range(25)],
                                    now=B - 10_000)
    fire = Recorder()
    report = make_engine(r, settings, fire, batch_size=10).tick(now_ms=B)
    assert report.due_seen == 25 and report.fired_count == 25 and not report.more_due
    assert sorted(fire.calls) == sorted((f"ent:c{i}", B) for i in range(25))


def test_quota_refuses_the_n_plus_first_run_in_the_hour_and_schedule_advances(r, settings):
    # registered within the tier's quota (batch: 10 an hour), which the operator then lowers
    # to 3: registration cannot refuse what is already registered, the fire's count does
    registered = settings.with_(tiers=tuple(replace(t, jitter_window_s=0) if t.name == "batch" else t
                                            for t in settings.tiers))
    TenantRegistry(r, registered).register("free1", "free")
    for i in range(5):
        CronStore(r, registered).add("free1", f"c{i}", "0 * * * *", PAYLOAD, now=B - 10_000)
    tiers = tuple(replace(t, max_tasks_per_hour=3, jitter_window_s=0) if t.name == "batch" else t
                  for t in settings.tiers)
    settings = settings.with_(tiers=tiers)
    store = CronStore(r, settings)
    fire = Recorder()
    eng = make_engine(r, settings, fire)
    report = eng.tick(now_ms=B)
    assert dict(report.statuses) == {"fired": 3, "quota": 2}
    assert len(fire.calls) == 3
    entries = store.list("free1")
    assert all(e.next_nominal_ms == B + HOUR for e in entries)          # all advanced
    assert Counter(e.last_status for e in entries) == {"fired": 3, "quota": 2}
    assert sum(e.skipped_count for e in entries) == 2
    # the refused runs are settled: not retried within the hour
    assert eng.tick(now_ms=B + 60_000).statuses == Counter()
    # a new hour, a new count
    report = eng.tick(now_ms=B + HOUR)
    assert dict(report.statuses) == {"fired": 3, "quota": 2}


def test_missed_runs_beyond_grace_are_skipped_within_grace_fire_once(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("ent", "late", "0 * * * *", PAYLOAD, now=B - 10_000)
    store.add("ent", "outage", "0 * * * *", PAYLOAD, now=B - 10_000)
    fire = Recorder()
    eng = make_engine(r, settings, fire, misfire_grace_s=600)
    # scheduler down from before 11:00 until 11:20: beyond the grace, skipped
    store.delete("ent", "outage")
    report = eng.tick(now_ms=B + 20 * 60_000)
    assert dict(report.statuses) == {"misfire": 1} and fire.calls == []
    late = store.get("ent", "late")
    assert late.next_nominal_ms == B + HOUR and late.last_status == "misfire"
    # down again from 11:59 to 14:05: 12:00, 13:00, 14:00 missed; only 14:00 fires
    store.add("ent", "outage", "0 * * * *", PAYLOAD, now=B + 20 * 60_000)
    report = eng.tick(now_ms=B + 3 * HOUR + 5 * 60_000)
    assert dict(report.statuses) == {"fired": 2}
    assert sorted(fire.calls) == [("ent:late", B + 3 * HOUR), ("ent:outage", B + 3 * HOUR)]
    assert store.get("ent", "outage").next_nominal_ms == B + 4 * HOUR


def test_idempotency_key_blocks_a_second_run_of_the_same_nominal(r, settings, tenants):
    CronStore(r, settings).add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    k = Keys(settings.key_prefix)
    r.set(k.cron_fired("ent:job", B), 1, px=60_000)      # someone already fired 11:00
    fire = Recorder()
    report = make_engine(r, settings, fire).tick(now_ms=B)
    assert dict(report.statuses) == {"duplicate": 1} and fire.calls == []
    assert CronStore(r, settings).get("ent", "job").next_nominal_ms == B + HOUR   # not stuck


def test_two_processes_racing_on_the_same_due_entries_fire_each_once(redis_url, r, settings, tenants):
    n = 300
    CronStore(r, settings).add_many([CronSpec("ent", f"c{i}", "0 * * * *", PAYLOAD) for i in range(n)],
                                    now=B - 10_000)
    fire = Recorder()
    engines = [make_engine(redis.Redis.from_url(redis_url), settings, fire, batch_size=16)
               for _ in range(3)]
    barrier = threading.Barrier(len(engines))
    reports = []

    def race(engine):
        barrier.wait()
        reports.append(engine.run_due(B))        # bypasses the lock on purpose

    threads = [threading.Thread(target=race, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(fire.calls) == sorted((f"ent:c{i}", B) for i in range(n))
    total = Counter()
    for rep in reports:
        total.update(rep.statuses)
    assert total["fired"] == n
    assert set(total) <= {"fired", "moved", "duplicate"}


def test_only_the_leader_fires(redis_url, r, settings, tenants):
    CronStore(r, settings).add_many([CronSpec("ent", f"c{i}", "*/5 * * * *", PAYLOAD) for i in range(4)],
                                    now=B - 10_000)
    fire_a, fire_b = Recorder(), Recorder()
    a = make_engine(redis.Redis.from_url(redis_url), settings, fire_a)
    b = make_engine(redis.Redis.from_url(redis_url), settings, fire_b)
    for minute in range(0, 30):
        now = B + minute * 60_000
        ra, rb = a.tick(now_ms=now), b.tick(now_ms=now)
        assert ra.leader and not rb.leader
    assert len(fire_a.calls) == 4 * 6 and fire_b.calls == []
    assert len(set(fire_a.calls)) == len(fire_a.calls)


def test_failover_within_two_ticks_after_the_leader_stops(redis_url, r, settings, tenants):
    tick_s = 0.2
    CronStore(r, settings).add("ent", "job", "*/5 * * * *", PAYLOAD, now=B - 10_000)
    fire_a, fire_b = Recorder(), Recorder()
    a = make_engine(redis.Redis.from_url(redis_url), settings, fire_a, tick_interval_s=tick_s)
    b = make_engine(redis.Redis.from_url(redis_url), settings, fire_b, tick_interval_s=tick_s)
    assert a.tick(now_ms=B).leader and not b.tick(now_ms=B).leader
    assert len(fire_a.calls) == 1
    # the leader stops ticking (killed); the follower keeps its tick rhythm
    follower_ticks = 0
    while not b.is_leader:
        time.sleep(tick_s)
        follower_ticks += 1
        b.tick(now_ms=B + 60_000)
        assert follower_ticks <= 4, "follower did not take over"
    # The lock's TTL is 1.5 ticks from the leader's last renewal, so the
    # follower (ticking every tick here) wins at its 1st or 2nd tick.
    assert follower_ticks <= 2
    report = b.tick(now_ms=B + 5 * 60_000)
    assert report.leader and report.fired_count == 1
    assert fire_b.calls == [("ent:job", B + 5 * 60_000)]
    # the old leader comes back: it is a follower now and fires nothing
    back = a.tick(now_ms=B + 10 * 60_000)
    assert not back.leader and len(fire_a.calls) == 1


def test_close_releases_the_lock_so_failover_is_immediate(redis_url, r, settings, tenants):
    a = make_engine(redis.Redis.from_url(redis_url), settings, Recorder())
    b = make_engine(redis.Redis.from_url(redis_url), settings, Recorder())
    assert a.tick(now_ms=B).leader and not b.tick(now_ms=B).leader
    a.close()
    assert b.tick(now_ms=B).leader


def test_fire_error_is_recorded_and_not_retried(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    fire = Recorder(fail=True)
    eng = make_engine(r, settings, fire)
    report = eng.tick(now_ms=B)
    assert report.statuses["fired"] == 1 and report.statuses["fire_error"] == 1
    assert report.fired[0].error == "RuntimeError: upstream down"
    got = store.get("ent", "job")
    assert got.last_status == "fire_error" and got.last_error == "RuntimeError: upstream down"
    assert got.next_nominal_ms == B + HOUR
    assert eng.tick(now_ms=B + 1000).statuses == Counter()          # at most once
    assert r.hget(Keys(settings.key_prefix).cron_stats, "fire_error") == b"1"


class Deferring(Recorder):
    """A fire function that defers (overload) its first ``times`` calls, then fires."""

    def __init__(self, retry_after_s: float, times: int = 10**9):
        super().__init__()
        self.retry_after_s, self.times = retry_after_s, times

    def __call__(self, entry, nominal_ms):
        from gateway_tasks.core.errors import Deferred
        got = super().__call__(entry, nominal_ms)
        if len(self.calls) <= self.times:
            raise Deferred(f"load level L3: new batch work is deferred from L3 on; retry after "
                           f"{self.retry_after_s:g} s", self.retry_after_s)
        return got


def retries(r, settings):
    return [(m.decode(), int(s)) for m, s in r.zrange(Keys(settings.key_prefix).cron_retry, 0, -1,
                                                      withscores=True)]


def test_a_deferred_run_is_counted_as_deferred_and_fired_again_after_its_retry_time(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    fire = Deferring(600.0, times=1)
    eng = make_engine(r, settings, fire)
    report = eng.tick(now_ms=B)
    assert report.statuses["fired"] == 1 and report.statuses["deferred"] == 1
    assert "fire_error" not in report.statuses
    got = store.get("ent", "job")
    assert got.last_status == "deferred" and got.last_error.startswith("Deferred: load level L3")
    assert "tried again at 2024-03-01T11:10:00" in got.last_error
    assert got.next_nominal_ms == B + HOUR                          # the schedule moved on meanwhile
    assert retries(r, settings) == [(f"ent:job|{B}", B + 600_000)]
    assert got.retry_at_ms == B + 600_000
    from beat.api import get_cron
    assert get_cron(settings, r, "ent", "job")["retry_at"] == "2024-03-01T11:10:00Z"
    assert eng.tick(now_ms=B + 599_999).fired == [] and len(fire.calls) == 1   # not yet
    again = eng.tick(now_ms=B + 600_000)
    assert fire.calls == [("ent:job", B), ("ent:job", B)]                   # the same nominal run
    assert again.statuses["retried"] == 1 and again.fired[0].task_id == "task-2"
    got = store.get("ent", "job")
    assert got.last_status == "fired" and got.last_task_id == "task-2" and got.last_error is None
    assert retries(r, settings) == [] and got.retry_at_ms == 0
    assert get_cron(settings, r, "ent", "job")["retry_at"] is None
    assert eng.tick(now_ms=B + 600_001).fired == []                         # once
    stats = r.hgetall(Keys(settings.key_prefix).cron_stats)
    assert stats[b"deferred"] == b"1" and stats[b"retried"] == b"1" and b"fire_error" not in stats
    assert b"superseded" not in stats


def test_a_deferred_run_whose_retry_time_is_past_the_next_run_is_superseded(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    eng = make_engine(r, settings, Deferring(3600.0))       # B + 1 h is the next run itself
    eng.tick(now_ms=B)
    got = store.get("ent", "job")
    assert got.last_status == "deferred" and "not tried again: the next run comes first" in got.last_error
    assert retries(r, settings) == []
    stats = r.hgetall(Keys(settings.key_prefix).cron_stats)
    assert stats[b"deferred"] == b"1" and stats[b"superseded"] == b"1"


def test_a_run_deferred_again_is_tried_until_the_next_run_supersedes_it(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    fire = Deferring(1500.0)                                # always deferred
    eng = make_engine(r, settings, fire)
    for at in (B, B + 1_500_000, B + 3_000_000):            # the third retry would be at B + 75 min
        eng.tick(now_ms=at)
    assert fire.calls == [("ent:job", B)] * 3
    assert retries(r, settings) == [] and store.get("ent", "job").retry_at_ms == 0
    eng.tick(now_ms=B + HOUR)                               # the next run, on its own schedule
    assert fire.calls[-1] == ("ent:job", B + HOUR) and retries(r, settings) == [
        (f"ent:job|{B + HOUR}", B + HOUR + 1_500_000)]
    stats = r.hgetall(Keys(settings.key_prefix).cron_stats)
    assert stats[b"deferred"] == b"4" and stats[b"superseded"] == b"1" and b"retried" not in stats


def test_the_retry_of_a_deleted_cron_is_dropped_and_two_schedulers_fire_a_retry_once(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("ent", "gone", "0 * * * *", PAYLOAD, now=B - 10_000)
    store.add("ent", "kept", "0 * * * *", PAYLOAD, now=B - 10_000)
    fire = Deferring(600.0, times=2)
    first, second = make_engine(r, settings, fire), make_engine(r, settings, fire)
    first.tick(now_ms=B)
    assert sorted(m for m, _ in retries(r, settings)) == [f"ent:gone|{B}", f"ent:kept|{B}"]
    store.delete("ent", "gone")                            # its pending retry goes with it
    assert [m for m, _ in retries(r, settings)] == [f"ent:kept|{B}"]
    report = first.run_due(B + 600_000)
    assert second.run_due(B + 600_000).fired == []          # claimed by the first: fired once
    assert [(f.entry_id, f.error) for f in report.fired] == [("ent:kept", None)]
    assert fire.calls[2:] == [("ent:kept", B)] and report.statuses["superseded"] == 0
    assert retries(r, settings) == []


def test_a_cron_deleted_and_added_again_does_not_fire_the_old_ones_deferred_run(r, settings, tenants):
    """The same id again (new payload) before the old run's retry time: the old deferred
    run is gone with the old cron; the new one runs on its own schedule only."""
    store = CronStore(r, settings)
    store.add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    store.add("ent", "jobs", "0 * * * *", PAYLOAD, now=B - 10_000)   # its id starts like job's
    fire = Deferring(600.0, times=2)
    eng = make_engine(r, settings, fire)
    eng.tick(now_ms=B)
    assert sorted(m for m, _ in retries(r, settings)) == sorted([f"ent:job|{B}", f"ent:jobs|{B}"])
    store.delete("ent", "job")
    store.add("ent", "job", "30 * * * *", {"messages": [{"role": "user", "content": "new"}]}, now=B + 1_000)
    report = eng.run_due(B + 600_000)
    assert [f.entry_id for f in report.fired] == ["ent:jobs"]   # not the deleted cron's run
    assert fire.calls[2:] == [("ent:jobs", B)]
    assert store.get("ent", "job").payload["messages"][0]["content"] == "new"


def test_a_deleted_tenant_is_skipped_and_tier_changes_apply_to_the_next_run(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("free1", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    store.add("pro1", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    tenants.delete("pro1")
    tenants.register("free1", "enterprise")                       # upgraded
    fire = Recorder()
    eng = make_engine(r, settings, fire)
    report = eng.tick(now_ms=B + 700_000 - 1)                     # all jittered runs passed
    assert dict(report.statuses) == {"fired": 1, "unknown_tenant": 1}
    upgraded = store.get("free1", "job")
    assert upgraded.tier == "vip" and upgraded.jitter_offset_s == 0
    assert upgraded.next_fire_ms == B + HOUR
    # the deleted tenant's generation ended: its cron was skipped, then deleted
    assert store.get("pro1", "job") is None and store.entry_ids("pro1") == []


def test_dangling_sorted_set_member_is_dropped(r, settings, tenants):
    k = Keys(settings.key_prefix)
    r.zadd(k.cron_due, {"ent:ghost": B})
    report = make_engine(r, settings, Recorder()).tick(now_ms=B)
    assert dict(report.statuses) == {"gone": 1}
    assert r.zscore(k.cron_due, "ent:ghost") is None


def test_corrupt_entry_is_quarantined_not_blocking_others(r, settings, tenants):
    store = CronStore(r, settings)
    store.add("ent", "bad", "0 * * * *", PAYLOAD, now=B - 10_000)
    store.add("ent", "good", "0 * * * *", PAYLOAD, now=B - 10_000)
    k = Keys(settings.key_prefix)
    r.hset(k.cron("ent:bad"), "cron", "not a cron")
    fire = Recorder()
    report = make_engine(r, settings, fire).tick(now_ms=B)
    assert dict(report.statuses) == {"fired": 1, "error": 1}
    assert fire.calls == [("ent:good", B)]
    assert r.zscore(k.cron_due, "ent:bad") == B + 60_000
    assert store.get("ent", "bad").last_status == "error"


def test_run_key_is_keyed_by_the_entry_secret():
    """The same (entry, nominal, secret) gives the same key on every replica; without the
    entry's secret neither the key nor the task id derived from it can be computed."""
    key = run_key("acme:digest", 1234, "a" * 32)
    assert key == run_key("acme:digest", 1234, "a" * 32) and key.startswith("cron:")
    assert "acme" not in key and "1234" not in key
    assert len({key, run_key("acme:digest", 1234, "b" * 32), run_key("acme:digest", 1235, "a" * 32),
                run_key("acme:other", 1234, "a" * 32)}) == 4


def test_score_disagreeing_with_the_hash_is_resynced(r, settings, tenants):
    CronStore(r, settings).add("ent", "job", "0 * * * *", PAYLOAD, now=B - 10_000)
    k = Keys(settings.key_prefix)
    r.zadd(k.cron_due, {"ent:job": B - 120_000})          # corrupt: earlier than the hash says
    fire = Recorder()
    report = make_engine(r, settings, fire).tick(now_ms=B - 60_000)
    assert dict(report.statuses) == {"resynced": 1} and fire.calls == []
    assert r.zscore(k.cron_due, "ent:job") == B


def test_slow_fire_calls_keep_the_lock_renewed(redis_url, r, settings, tenants):
    CronStore(r, settings).add_many([CronSpec("ent", f"c{i}", "0 * * * *", PAYLOAD) for i in range(6)],
                                    now=B - 10_000)

    def slow_fire(entry, nominal_ms):
        time.sleep(0.06)
        return "t"

    a = make_engine(redis.Redis.from_url(redis_url), settings, slow_fire, tick_interval_s=0.1)
    b = make_engine(redis.Redis.from_url(redis_url), settings, Recorder(), tick_interval_s=0.1)
    report = a.tick(now_ms=B)                   # 6 x 60 ms > the 200 ms lock TTL
    assert report.fired_count == 6 and a.is_leader
    assert not b.tick(now_ms=B).leader


def test_runs_due_together_fire_vip_first_and_in_parallel(r, settings):
    flat = settings.with_(tiers=tuple(replace(t, jitter_window_s=0) for t in settings.tiers))
    reg = TenantRegistry(r, flat)
    store = CronStore(r, flat)
    specs = []
    for tier, n in (("batch", 12), ("normal", 6), ("vip", 6)):      # ids sort batch < normal < vip
        for i in range(n):
            reg.register(f"{tier}-{i}", tier)
            specs.append(CronSpec(f"{tier}-{i}", "job", "0 * * * *", PAYLOAD))
    store.add_many(specs, now=B - 60_000)
    started: list[str] = []
    threads: set[str] = set()
    lock = threading.Lock()
    gate = threading.Barrier(4, timeout=10)     # passes only if 4 fire calls run at once

    def fire(entry, nominal_ms):
        with lock:
            started.append(entry.tier)
            threads.add(threading.current_thread().name)
            first_four = len(started) <= 4
        if first_four:
            gate.wait()
        return f"t-{entry.entry_id}"

    engine = make_engine(r, flat, fire, fire_concurrency=4, batch_size=8)   # 3 chunks
    try:
        report = engine.run_due(B)
    finally:
        engine.close()
    assert report.fired_count == 24 and len(started) == 24 and len(threads) == 4
    assert started[:4] == ["vip"] * 4          # the first calls in flight are VIP runs
    assert started.count("vip") == 6 and started[-1] != "vip"
    assert "batch" not in started[:6 + 6 - 4]     # across chunks: vip, then normal, then batch
    assert {e.last_task_id for e in store.list()} == {f"t-{s.tenant_id}:job" for s in specs}
    with pytest.raises(Exception, match="fire_concurrency"):
        make_engine(r, flat, fire, fire_concurrency=0)
