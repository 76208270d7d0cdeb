"""A worker's start: it says which configuration it loaded, and it refuses to start
without the API keys of the pools it calls.

Only workers call the upstream, so only they need its keys: every other process
loads a pool whose ``api_key_env`` variable is not set as a pool without its key
there (gateway_tasks.core.settings).  A worker, on ``worker_init`` (its queues
selected, before its consumer starts), writes its configuration line
(gateway_tasks.core.config_report: the source, each pool's name, base URL and
whether its key is present) and checks the keys of the pools it may call -- the
pools of the gateway queues it consumes and, for a tier with a reserved share, their
``backup_pools`` (workers/failover.py).  A missing one stops it with one line
naming the pool and the variable, and exit status 2 (a ConfigError, as the
``gateway`` command reports one), before it takes a task: never a failure per task.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

from celery.signals import worker_init

from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.core.config_report import announce
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.keys import split_queue_name
from gateway_tasks.core.settings import Settings

EXIT_CONFIG_ERROR = 2   # the `gateway` command's exit status for a GatewayError


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


def check_worker(settings: Settings, queues: Iterable[str]) -> None:
    """Announce the configuration; raise ConfigError if a pool it calls has no key here."""
    announce(settings, "worker", keys=True)
    settings.require_keys(called_pools(settings, queues), "this worker")


@worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        check_worker(settings_of(app), app.amqp.queues.consume_from or ())
    except ConfigError as exc:
        # Celery logs and swallows a signal handler's exception: leave before the consumer starts
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG_ERROR) from None
