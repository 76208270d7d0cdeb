"""The workers' Celery app: the producer's configuration on the dispatching
transport (``workers.transport``), with the inference task registered.

    celery -A workers.app worker -Q gt.vip.default,gt.normal.default,gt.batch.default -E

A worker with a bad configuration -- settings that do not load, a ``-Q`` queue of an
unknown tier or pool -- stops before it consumes anything, with one critical line
(``gateway worker: configuration error: ...``) and exit status 78
(``gateway_tasks.core.celery_app.stop_on_config_error``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import celeryd_after_setup

from gateway_tasks.core.broker import is_gateway_queue
from gateway_tasks.core.celery_app import lazy_app, make_app, stop_on_config_error
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import Settings, get_settings
from workers.redaction import install_log_filter
from workers.router import PickPlan

WORKER_TRANSPORT = "workers.transport:Transport"
# workers.overload: the load-level controller, started by each worker when it is ready;
# workers.warmup: the openai SDK's one-time work, done before the worker takes a task;
# workers.interpreter: the process's GIL switch interval and its startup objects frozen
TASK_MODULES = ("workers.tasks", "workers.overload", "workers.warmup", "workers.interpreter")


def make_worker_app(settings: Settings, redis_url: str | None = None, name: str = "gateway-worker",
                    **conf: Any) -> Celery:
    app = make_app(settings, redis_url, name, transport=WORKER_TRANSPORT, imports=TASK_MODULES, **conf)
    import workers.tasks  # noqa: F401  (registers gateway.infer / gateway.noop on shared_task apps)
    install_log_filter()   # results stay out of the worker's log
    app.gateway_worker = True   # type: ignore[attr-defined]  (check_queues: a worker of this app)
    return app


def check_queues(app: Celery) -> None:
    """ConfigError unless the queues a worker of ``app`` consumes are ones the transport can
    dispatch: gateway queues of known tiers and pools (the plan it would build), or none."""
    queues = app.amqp.queues
    names = sorted(queues.consume_from or queues)
    if names and all(is_gateway_queue(n) for n in names):
        PickPlan(app.gateway_settings, names)   # type: ignore[attr-defined]


@celeryd_after_setup.connect
def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    # after -Q is applied and logging is set up, before the banner and the first poll
    app = getattr(instance, "app", None)
    if not getattr(app, "gateway_worker", False):
        return
    try:
        check_queues(app)
    except ConfigError as exc:
        stop_on_config_error("gateway worker", exc)


default_app, __getattr__ = lazy_app(lambda: make_worker_app(get_settings()), "gateway worker")
