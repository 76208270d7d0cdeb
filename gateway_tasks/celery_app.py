"""The Celery application: JSON only, late acks, prefetch 1, events on for Flower.

``make_app(settings)`` builds an app bound to one deployment (its Redis URL and
key prefix); ``app`` is the process-wide one built from the environment, used
by ``celery -A gateway_tasks.celery_app worker`` and by Flower.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Celery

from .settings import Settings, get_settings, settings_from_json, settings_to_json

TRANSPORT = "gateway_tasks.transport:Transport"
TASK_NAME = "gateway.infer"
# The settings travel as JSON under a name Celery censors in `inspect conf`
# (it hides keys matching SECRET), so Flower never shows the pools' API keys.
SETTINGS_KEY = "gateway_settings_secret"


def celery_config(settings: Settings, redis_url: str) -> dict[str, Any]:
    prefix = settings.key_prefix
    settings_json = settings_to_json(settings)
    return {
        "broker_url": redis_url,
        "broker_transport": TRANSPORT,
        "broker_transport_options": {
            "global_keyprefix": prefix,
            "visibility_timeout": settings.visibility_timeout_s,
            SETTINGS_KEY: settings_json,
        },
        "broker_connection_retry_on_startup": True,
        "result_backend": redis_url,
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "result_expires": settings.result_ttl_s,
        "result_extended": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "task_default_queue": settings.queue_names()[0],
        "task_create_missing_queues": True,
        "worker_hijack_root_logger": False,
        "beat_scheduler": "beat.scheduler:TenantCronScheduler",
        SETTINGS_KEY: settings_json,
        "imports": ["workers.tasks"],
    }


def make_app(settings: Settings, redis_url: str | None = None, name: str = "gateway") -> Celery:
    url = redis_url or settings.redis_url
    if not url:
        from .errors import ConfigError
        raise ConfigError("REDIS_URL is not set; `gateway` commands and `make demo` start an "
                          "embedded Redis for you, a worker needs REDIS_URL=redis://host:port/db")
    celery = Celery(name)
    celery.conf.update(celery_config(settings, url))
    import workers.tasks  # noqa: F401  (registers gateway.infer on shared_task apps)
    return celery


def settings_of(app: Celery) -> Settings:
    """The gateway settings an app was built with (else the environment's)."""
    text = app.conf.get(SETTINGS_KEY)
    return settings_from_json(text) if text else get_settings()


@lru_cache(maxsize=1)
def default_app() -> Celery:
    return make_app(get_settings())


def __getattr__(name: str) -> Any:
    # `celery -A gateway_tasks.celery_app` looks up `app` / `celery` lazily, so
    # importing this module never needs REDIS_URL.
    if name in ("app", "celery"):
        return default_app()
    raise AttributeError(name)
