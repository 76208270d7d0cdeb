"""TenantCronScheduler as a Celery beat scheduler class."""

from __future__ import annotations

import pytest
from celery import Celery

from beat.scheduler import TenantCronScheduler
from beat.store import CronStore
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import Keys
from gateway_tasks.tenants.registry import TenantRegistry

B = 1_709_290_800_000            # 2024-03-01T11:00:00Z
PAYLOAD = {"messages": [{"role": "user", "content": "ping"}]}
FIRED: list[tuple[str, int]] = []


def recording_fire(entry, nominal_ms):
    FIRED.append((entry.entry_id, nominal_ms))
    return "task-x"


def make_app(**conf):
    app = Celery("beat-test", set_as_current=False, broker="memory://")
    app.conf.result_expires = None          # no default celery.backend_cleanup entry
    app.conf.update(conf)
    return app


@pytest.fixture
def cron(r, settings):
    TenantRegistry(r, settings).register("ent", "enterprise")
    CronStore(r, settings).add("ent", "job", "*/5 * * * *", PAYLOAD, now=B - 10_000)


def test_scheduler_ticks_fire_due_crons_and_close_releases_the_lock(r, settings, cron):
    FIRED.clear()
    clock = [B / 1000]
    app = make_app(gateway_settings=settings, gateway_beat_fire=f"{__name__}:recording_fire",
                   gateway_beat_tick_interval_s=0.5)
    s = TenantCronScheduler(app=app, client=r, clock=lambda: clock[0])
    assert s.engine.tick_interval_s == 0.5 and s.engine.lock.ttl_ms == 750
    delay = s.tick()
    assert s.is_leader and FIRED == [("ent:job", B)]
    assert 0 <= delay <= 0.5
    clock[0] += 300
    s.tick()
    assert FIRED == [("ent:job", B), ("ent:job", B + 300_000)]
    assert "tenant crons" in s.info
    s.close()
    assert r.get(Keys(settings.key_prefix).beat_lock) is None


def test_follower_scheduler_retries_every_quarter_tick_and_fires_nothing(r, settings, cron):
    fired_a, fired_b = [], []
    app = make_app()
    a = TenantCronScheduler(app=app, settings=settings, client=r, clock=lambda: B / 1000,
                            fire=lambda e, n: fired_a.append(n), tick_interval_s=0.5)
    b = TenantCronScheduler(app=app, settings=settings, client=r, clock=lambda: B / 1000,
                            fire=lambda e, n: fired_b.append(n), tick_interval_s=0.5)
    a.tick()
    assert b.tick() == 0.125 and not b.is_leader       # a quarter tick: quick takeover
    assert fired_a == [B] and fired_b == []
    a.close()
    b.close()


def test_static_beat_schedule_entries_are_kept_for_the_leader(r, settings, cron):
    app = make_app(beat_schedule={"hourly-noop": {"task": "noop", "schedule": 3600.0}})
    s = TenantCronScheduler(app=app, settings=settings, client=r, clock=lambda: B / 1000,
                            fire=lambda e, n: None, tick_interval_s=0.5)
    assert "hourly-noop" in s.schedule
    assert 0 <= s.tick() <= 0.5                     # parent heap consulted, nothing due
    assert s._heap is not None
    s.close()


def test_needs_a_redis_url(settings):
    with pytest.raises(ConfigError, match="REDIS_URL"):
        TenantCronScheduler(app=make_app(), settings=settings.with_(redis_url=""))


def test_redis_errors_do_not_stop_beat(settings):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2,
                       retry=Retry(NoBackoff(), 0))
    s = TenantCronScheduler(app=make_app(), settings=settings, client=dead,
                            fire=lambda e, n: None, tick_interval_s=0.3)
    assert s.tick() == 0.3 and not s.is_leader


def test_leader_publishes_the_demand_forecast_and_followers_do_not(r, settings, cron):
    from beat.forecast import read_published

    clock = [B / 1000 - 60]
    app = make_app(gateway_beat_forecast_interval_s=15, gateway_beat_forecast_horizon_s=600)
    lead = TenantCronScheduler(app=app, settings=settings, client=r, clock=lambda: clock[0],
                               fire=lambda e, n: "t", tick_interval_s=0.5)
    follow = TenantCronScheduler(app=app, settings=settings, client=r, clock=lambda: clock[0],
                                 fire=lambda e, n: "t", tick_interval_s=0.5)
    lead.tick()
    follow.tick()
    assert lead.is_leader and not follow.is_leader
    assert follow.forecast is not None and follow.forecast.last is None
    fc = read_published(r, settings)
    assert fc is not None and fc.start_ms == B - 60_000
    (series,) = fc.series.values()
    assert series.runs == [0, 1, 0, 0, 0, 0, 1, 0, 0, 0]       # */5 from 10:59: 11:00 and 11:05
    off = TenantCronScheduler(app=make_app(gateway_beat_forecast_interval_s=0), settings=settings,
                              client=r, fire=lambda e, n: "t")
    assert off.forecast is None
    lead.close()


def test_the_banner_line_shows_no_redis_password(settings, r):
    with_password = settings.with_(redis_password="hunter2-banner")
    assert "hunter2-banner" in with_password.redis_url          # the URL the client connects with
    s = TenantCronScheduler(app=make_app(), settings=with_password, client=r, fire=lambda e, n: None)
    try:
        assert "hunter2-banner" not in s.info and repr(settings.key_prefix) in s.info
    finally:
        s.close()
