"""The beat process's Celery app: the producer's app with the tenant cron scheduler.

    celery -A beat.app beat

A bad configuration (settings that do not load, no REDIS_URL) stops beat with one
critical line, ``gateway beat: configuration error: ...``, and exit status 78
(``gateway_tasks.core.celery_app.stop_on_config_error``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import beat_init

from gateway_tasks.core.celery_app import lazy_app, make_app, settings_of, stop_on_config_error
from gateway_tasks.core.config_report import announce
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import Settings, get_settings

from beat.scheduler import TenantCronScheduler

SCHEDULER = "beat.app:process_scheduler"


def process_scheduler(app: Celery, *args: Any, **kwargs: Any) -> TenantCronScheduler:
    """The beat process's scheduler (Celery calls ``beat_scheduler`` with the app): a
    TenantCronScheduler, or the process ends on a ConfigError."""
    try:
        return TenantCronScheduler(app, *args, **kwargs)
    except ConfigError as exc:
        stop_on_config_error("gateway beat", exc)


def make_beat_app(settings: Settings, redis_url: str | None = None, **conf: Any) -> Celery:
    return make_app(settings, redis_url, "gateway-beat", beat_scheduler=SCHEDULER, **conf)


@beat_init.connect
def _announce(sender: Any = None, **_: Any) -> None:
    """Beat says which configuration it loaded, once, as it starts (config_report)."""
    app = getattr(sender, "app", None)
    if app is not None:
        announce(settings_of(app), "beat")


default_app, __getattr__ = lazy_app(lambda: make_beat_app(get_settings()), "gateway beat")
