"""The workers' Celery app: the producer's configuration on the dispatching
transport (``gateway_tasks.dispatch.transport``), with the inference task registered.

    celery -A workers.app worker -Q gt.vip.default,gt.normal.default,gt.batch.default -E

A worker with a bad configuration -- settings that do not load, a ``-Q`` queue of an
unknown tier or pool -- stops before it consumes anything, with one critical line
(``gateway worker: configuration error: ...``) and exit status 78
(``workers.startup``).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from gateway_tasks.core.celery_app import lazy_app, make_app
from gateway_tasks.core.settings import Settings, get_settings
from workers.redaction import install_log_filter

WORKER_TRANSPORT = "gateway_tasks.dispatch.transport:Transport"
# workers.startup: no start with queues it cannot serve or without the called pools' keys;
# gateway_tasks.overload.controller: the load-level controller, started by each worker when it is ready;
# workers.warmup: the openai SDK's one-time work, done before the worker takes a task;
# workers.interpreter: the process's GIL switch interval and its startup objects frozen
TASK_MODULES = ("workers.startup", "workers.tasks", "gateway_tasks.overload.controller", "workers.warmup",
                "workers.interpreter")


def make_worker_app(settings: Settings, redis_url: str | None = None, name: str = "gateway-worker",
                    **conf: Any) -> Celery:
    app = make_app(settings, redis_url, name, transport=WORKER_TRANSPORT, imports=TASK_MODULES, **conf)
    import workers.tasks  # noqa: F401  (registers gateway.infer / gateway.noop on shared_task apps)
    install_log_filter()   # results stay out of the worker's log
    app.gateway_worker = True   # type: ignore[attr-defined]  (workers.startup: a worker of this app)
    return app


default_app, __getattr__ = lazy_app(lambda: make_worker_app(get_settings()), "gateway worker")
