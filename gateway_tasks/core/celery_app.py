"""The Celery application: JSON only, late acks, prefetch 1, events on for Flower.

``make_app(settings)`` builds an app bound to one deployment (its Redis URL and
key prefix) on the producer-side transport.  Its broker connection goes to the
control Redis when the settings name one (``control_redis_url``: required on a
Redis Cluster, where Celery's bindings, control replies and events cannot live)
and the gateway's transport runs every gateway operation on the deployment's
Redis (``gateway_tasks.dispatch.broker``); results stay on the deployment's Redis
(``gateway_tasks.core.result_backend``). ``workers.app`` builds the
consumer's app on the dispatching transport and ``beat.app`` the scheduler's.
``app`` is the process-wide producer app built from the environment, used by
``celery -A gateway_tasks.core.celery_app flower``.

Secrets never travel in the Celery configuration: the app keeps its Settings
as a Python attribute (``app.gateway_settings``), and the broker's transport
options -- which ``inspect stats`` and Flower's worker page print -- carry only
the settings' public view (API keys removed).
"""

from __future__ import annotations

import logging
import weakref
from functools import lru_cache
from typing import Any, Callable, NoReturn, Sequence

from celery import Celery

from gateway_tasks.core.errors import EXIT_CONFIG, ConfigError
from gateway_tasks.core.result_backend import backend_url
from gateway_tasks.core.settings import Settings, get_settings, settings_to_json
from gateway_tasks.core.urls import is_cluster_url

PRODUCER_TRANSPORT = "gateway_tasks.dispatch.broker:Transport"
TASK_NAME = "gateway.infer"

log = logging.getLogger(__name__)

# transport option holding the settings' public view (no API keys)
PUBLIC_SETTINGS_OPTION = "gateway_public_settings"

# the settings of this process's apps by their public view: a channel reads the public view
# from its transport options and finds here the settings it was made from, credentials
# included (the deployment's Redis, when the broker is another Redis: control_redis_url)
_behind_public: "weakref.WeakValueDictionary[str, Settings]" = weakref.WeakValueDictionary()


def public_view(settings: Settings) -> str:
    """The settings' public view as JSON (the transport option), remembered as theirs."""
    text = settings_to_json(settings.public())
    _behind_public[text] = settings
    return text


def settings_behind(public_json: str) -> Settings | None:
    """The settings of this process whose public view is ``public_json`` (None: not made here)."""
    return _behind_public.get(public_json)


def celery_config(settings: Settings, redis_url: str, *,
                  transport: str = PRODUCER_TRANSPORT) -> dict[str, Any]:
    """The Celery configuration of a deployment whose Redis is at ``redis_url`` (its results
    there; the broker at ``settings.control_redis_url`` when set, else there too)."""
    prefix = settings.key_prefix
    if is_cluster_url(redis_url) and not settings.control_redis_url:
        settings.with_(redis_url=redis_url)   # raises the ConfigError naming control_redis_url
    return {
        "broker_url": settings.control_redis_url or redis_url,
        "broker_transport": transport,
        "broker_transport_options": {
            "global_keyprefix": prefix,
            "visibility_timeout": settings.visibility_timeout_s,
            PUBLIC_SETTINGS_OPTION: public_view(settings),
        },
        "broker_connection_retry_on_startup": True,
        "result_backend": backend_url(redis_url),
        "result_backend_transport_options": {"global_keyprefix": prefix},
        # a result stored while Redis restarts, or while it is at its maxmemory, waits for it
        # (exponential back-off, ~1 min in all; gateway_tasks.core.result_backend) instead of
        # being dropped: a task that ran must reach its final state
        "result_backend_always_retry": True,
        "result_backend_max_retries": 20,
        "result_expires": settings.result_ttl_s,
        # no extended results: they would keep every task's arguments -- its whole prompt --
        # in Redis for result_ttl_s (doubling the memory a drained queue still holds)
        "result_extended": False,
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
    }


def make_app(settings: Settings, redis_url: str | None = None, name: str = "gateway", *,
             transport: str = PRODUCER_TRANSPORT, imports: Sequence[str] = (),
             **conf: Any) -> Celery:
    url = redis_url or settings.require_redis_url("a gateway Celery app")
    if url != settings.redis_url:
        # the app's processes (its workers' tasks, the transport when the broker is a control
        # Redis) find the deployment's Redis in its settings
        settings = settings.with_(redis_url=url)
    celery = Celery(name)
    celery.conf.update(celery_config(settings, settings.redis_url, transport=transport), imports=list(imports),
                       **conf)
    celery.gateway_settings = settings  # type: ignore[attr-defined]
    return celery


def settings_of(app: Celery) -> Settings:
    """The gateway settings an app was built with (else the environment's)."""
    found = getattr(app, "gateway_settings", None)
    return found if isinstance(found, Settings) else get_settings()


def stop_on_config_error(role: str, exc: ConfigError) -> NoReturn:
    """End a Celery process (worker, beat, Flower) that cannot run with this configuration:
    one critical log line, ``<role>: configuration error: ...``, and exit status EXIT_CONFIG
    (78, Celery's EX_CONFIG) -- no traceback.  Before Celery has set up logging the line
    goes to stderr as it is (logging's last-resort handler)."""
    log.critical("%s: configuration error: %s", role, exc)
    raise SystemExit(EXIT_CONFIG)


def lazy_app(factory: Callable[[], Celery], role: str = "gateway") -> tuple[Callable[[], Celery],
                                                                          Callable[[str], Any]]:
    """(default_app, module __getattr__) for a module that ``celery -A`` names: its
    ``app`` is built from the environment on first use, so importing the module
    never needs REDIS_URL.  That first use is ``celery -A`` loading the app: a
    ConfigError then ends the process (``stop_on_config_error``, ``role`` naming it)."""
    default = lru_cache(maxsize=1)(factory)

    def module_getattr(name: str) -> Any:
        if name in ("app", "celery"):
            try:
                return default()
            except ConfigError as exc:
                stop_on_config_error(role, exc)
        raise AttributeError(name)

    return default, module_getattr


default_app, __getattr__ = lazy_app(lambda: make_app(get_settings()))
