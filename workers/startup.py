"""A worker's start: it refuses a configuration it cannot serve, says which
configuration it loaded, and refuses to start without the API keys of the pools it calls.

One hook, on ``celeryd_after_setup`` (its ``-Q`` queues applied and logging set up,
before the banner and the first poll), checks in order:

* the queues: gateway queues of known tiers and pools (the plan the transport would
  build), or none -- and on a Redis Cluster the queues of one pool only: pick.lua takes
  the pools of a worker's queues in one call, and a pool's keys share one hash slot, so
  the pools of one worker would cross slots (run one worker per pool there);
* the configuration line (gateway_tasks.core.config_report: the source, each pool's
  name, base URL and whether its key is present);
* the keys: only workers call the upstream, so only they need its keys -- every other
  process loads a pool whose ``api_key_env`` variable is not set as a pool without its
  key there (gateway_tasks.core.settings).  The pools it may call are those of the
  gateway queues it consumes and, for a tier with a reserved share, their
  ``backup_pools`` (gateway_tasks/upstream/failover.py).

A failed check stops the worker with one critical line, ``gateway worker: configuration
error: ...``, and exit status 78 (``stop_on_config_error``) before it takes a task:
never a failure per task.
"""

from __future__ import annotations

from typing import Any, Iterable

from celery import Celery
from celery.signals import celeryd_after_setup

from gateway_tasks.dispatch.broker import is_gateway_queue
from gateway_tasks.core.celery_app import stop_on_config_error
from gateway_tasks.core.config_report import announce
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import split_queue_name
from gateway_tasks.core.settings import Settings
from gateway_tasks.dispatch.router import PickPlan


def called_pools(settings: Settings, queues: Iterable[str]) -> list[str]:
    """The pools a worker consuming ``queues`` may call, in settings order."""
    known = {p.name: p for p in settings.pools}
    tier_names = {n for t in settings.tiers for n in (t.name, *t.aliases)}
    wanted: set[str] = set()
    for queue in queues:
        parts = split_queue_name(queue)
        if parts is None or parts[1] not in known:
            continue
        tier, pool = parts
        wanted.add(pool)
        if tier in tier_names and settings.tier(tier).reserved_share > 0:
            wanted.update(known[pool].backup_pools)
    return [p.name for p in settings.pools if p.name in wanted]


def check_queues(settings: Settings, names: list[str]) -> None:
    """ConfigError unless ``names`` are queues the transport can dispatch: gateway queues
    of known tiers and pools (the plan it would build), or none; on a Redis Cluster, of one pool."""
    if names and all(is_gateway_queue(n) for n in names):
        PickPlan(settings, names)
    pools = sorted({parts[1] for parts in map(split_queue_name, names) if parts is not None})
    if settings.redis_cluster and len(pools) > 1:
        example = ",".join(settings.queue_name(t.name, pools[0]) for t in settings.tiers)
        raise ConfigError(f"on a Redis Cluster a worker serves the queues of one pool, and these -Q queues "
                          f"are of {len(pools)} pools {pools} (each pool's keys live in one hash slot, and "
                          f"a pick takes a worker's pools in one call); run one worker per pool, e.g. "
                          f"-Q {example} (docs/redis-cluster.md)")


def check_worker(app: Celery) -> None:
    """The start checks of a worker of ``app`` (see the module's docstring)."""
    settings: Settings = app.gateway_settings   # type: ignore[attr-defined]
    queues = app.amqp.queues
    names = sorted(queues.consume_from or queues)
    check_queues(settings, names)
    announce(settings, "worker", keys=True)
    settings.require_keys(called_pools(settings, names), "this worker")


@celeryd_after_setup.connect
def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    app = getattr(instance, "app", None)
    if not getattr(app, "gateway_worker", False):
        return
    try:
        check_worker(app)
    except ConfigError as exc:
        stop_on_config_error("gateway worker", exc)
