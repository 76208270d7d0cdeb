"""Celery beat scheduler for tenant crons stored in Redis.

    celery -A beat.app beat

(``beat.app`` sets ``app.conf.beat_scheduler`` to ``beat.app:process_scheduler``, which
builds this class).  Run as many beat processes as you like: one is active (the Redis
lock), the others wait and take over within 1.75 ticks if it stops (``beat.lock``).

Configuration (all optional):

* ``app.conf.gateway_settings``: a ``gateway_tasks.core.settings.Settings``;
  else the settings the app was built with (``gateway_tasks.core.celery_app.
  settings_of``), else ``gateway_tasks.core.settings.get_settings()`` (needs REDIS_URL);
* ``app.conf.gateway_beat_tick_interval_s``: the tick interval (default 1 s;
  the leader lock's TTL is 1.5 times this, renewed every half tick);
* ``app.conf.gateway_beat_misfire_grace_s``: default 600 s;
* ``app.conf.gateway_beat_fire_concurrency``: submits in flight at once when
  many runs are due together (default 1, one after the other: against a local
  Redis 8 threads fired 2,000 runs at 340-350/s against 460-590/s for one, the
  submit being CPU-bound; more may pay where each submit waits on a remote
  Redis's round trips);
* ``app.conf.gateway_beat_forecast_interval_s``: how often the leader publishes
  the token-demand forecast of the schedule (``beat.forecast``; default 15 s,
  0 disables); ``gateway_beat_forecast_horizon_s`` (600) and
  ``gateway_beat_forecast_bucket_s`` (60) shape it;
* ``app.conf.gateway_beat_fire``: a fire function (or "module:attr") instead
  of submitting through ``gateway_tasks.producer.gateway.Gateway``.

Static ``beat_schedule`` entries still work: they are handled by Celery's own
in-memory heap (the parent class), but only while this process is the leader,
so replicas do not send them twice.  Their state is not shared between
replicas: after a failover the new leader runs them from its own heap (a run
whose time passed during the failover is not caught up).
"""

from __future__ import annotations

from typing import Any, Callable

import redis
from celery.beat import Scheduler
from celery.utils.log import get_logger
from celery.utils.imports import symbol_by_name

from gateway_tasks.core.settings import Settings, get_settings
from gateway_tasks.core.redis_client import data_client
from gateway_tasks.core.urls import without_credentials

from beat.engine import DEFAULT_TICK_INTERVAL_S, CronEngine, TickReport
from beat.fire import FireFn, gateway_fire
from beat.forecast import (DEFAULT_BUCKET_S, DEFAULT_HORIZON_S, DEFAULT_PUBLISH_INTERVAL_S,
                           ForecastPublisher)
from beat.schedule import MISFIRE_GRACE_S

logger = get_logger(__name__)
FIRE_CONCURRENCY = 1


def _conf(app: Any, name: str, default: Any = None) -> Any:
    try:
        value = app.conf.get(name)
    except Exception:  # noqa: BLE001 -- a bare Mapping-less conf
        value = getattr(app.conf, name, None)
    return default if value is None else value


def _app_settings(app: Any) -> Settings:
    try:
        from gateway_tasks.core.celery_app import settings_of
    except ImportError:
        return get_settings()
    return settings_of(app)


class TenantCronScheduler(Scheduler):
    """``celery.beat.Scheduler`` whose tick settles due tenant crons from Redis."""

    def __init__(self, app: Any, *args: Any, settings: Settings | None = None,
                 client: redis.Redis | None = None, fire: FireFn | None = None,
                 clock: Callable[[], float] | None = None, tick_interval_s: float | None = None,
                 misfire_grace_s: int | None = None, **kwargs: Any):
        settings = settings or _conf(app, "gateway_settings") or _app_settings(app)
        if client is None:
            client = data_client(settings, "the tenant cron scheduler")
        fire = fire or _conf(app, "gateway_beat_fire")
        if isinstance(fire, str):
            fire = symbol_by_name(fire)
        if fire is None:
            fire = gateway_fire(settings, app=app, client=client)
        engine_kwargs: dict[str, Any] = {
            "tick_interval_s": float(tick_interval_s or _conf(app, "gateway_beat_tick_interval_s",
                                                             DEFAULT_TICK_INTERVAL_S)),
            "misfire_grace_s": int(misfire_grace_s if misfire_grace_s is not None else
                                   _conf(app, "gateway_beat_misfire_grace_s", MISFIRE_GRACE_S)),
            "fire_concurrency": int(_conf(app, "gateway_beat_fire_concurrency", FIRE_CONCURRENCY)),
        }
        if clock is not None:
            engine_kwargs["clock"] = clock
        self.gateway_settings = settings
        self.engine = CronEngine(client, settings, fire, **engine_kwargs)
        interval = float(_conf(app, "gateway_beat_forecast_interval_s", DEFAULT_PUBLISH_INTERVAL_S))
        self.forecast: ForecastPublisher | None = None
        if interval > 0:
            self.forecast = ForecastPublisher(
                client, settings, interval,
                int(_conf(app, "gateway_beat_forecast_horizon_s", DEFAULT_HORIZON_S)),
                int(_conf(app, "gateway_beat_forecast_bucket_s", DEFAULT_BUCKET_S)))
        self.last_report: TickReport | None = None
        super().__init__(app, *args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One iteration: returns the seconds to sleep before the next one."""
        try:
            report = self.engine.tick()
        except redis.RedisError as exc:
            # Redis unreachable: we cannot know whether we still lead, so act as a
            # follower (the lock will have lapsed by the time Redis is back).
            self.engine.lock.held = False
            logger.error("beat: tenant crons skipped this tick, Redis error: %s", exc)
            return self.engine.tick_interval_s
        self.last_report = report
        if not report.leader:
            return report.delay_s
        self._publish_forecast(report)
        delay = min(report.delay_s, self.engine.tick_interval_s)
        if self.schedule:                      # static beat_schedule entries (leader only)
            delay = min(delay, super().tick(*args, **kwargs))
        return max(0.0, min(delay, self.max_interval))

    def _publish_forecast(self, report: TickReport) -> None:
        if self.forecast is None:
            return
        try:
            self.forecast.maybe_publish(self.engine.now_ms(), busy=report.more_due)
        except redis.RedisError as exc:
            logger.warning("beat: could not publish the demand forecast: %s", exc)

    @property
    def is_leader(self) -> bool:
        return self.engine.is_leader

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.engine.close()

    @property
    def info(self) -> str:
        s = self.gateway_settings
        return (f"    . tenant crons: redis {without_credentials(s.redis_url) or '?'} prefix {s.key_prefix!r}, "
                f"tick {self.engine.tick_interval_s}s, lock {self.engine.lock.token}")
