"""`gateway task show|list|result|cancel`: a submitted task (an operator's command: any
tenant's task, or only TENANT's with --tenant).

  show ID     its state, tier and lane, place in line, expected start and why it waits, or
              its result (JSON, as GET /v1/tasks/{id}; gateway_tasks.producer.where)
  list        --tenant T [--state S] [--limit N]: the tenant's tasks, newest first
  result ID   [--wait S]: its result (JSON); exit status 1 when it failed or is not ready
              (within S seconds)
  cancel ID   a queued task is removed at once and never reaches the upstream; a running one
              is revoked and its result discarded.  Prints JSON {task_id, cancelled, was,
              status}; exit status 0 when it was cancelled (now or before), 1 when it had
              already finished

An unknown task id (or another tenant's, with --tenant) is exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from celery import states

from gateway_tasks.core.settings import get_settings
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.producer.where import STATES, list_tasks, task_status
from gateway_tasks.rest.results import error_of


def _gateway(command: str) -> Gateway:
    settings = get_settings()
    settings.require_redis_url(f"`gateway task {command}`")
    return Gateway(settings)


def _print(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _cancel(args: argparse.Namespace) -> int:
    gateway = _gateway("cancel")
    try:
        done = gateway.cancel(args.task_id, args.tenant)
    finally:
        gateway.app.close()
    _print({"task_id": done.task_id, "cancelled": done.cancelled, "was": done.was, "status": done.status})
    return 0 if done.cancelled else 1


def _show(args: argparse.Namespace) -> int:
    gateway = _gateway("show")
    try:
        _print(task_status(gateway, args.task_id, args.tenant, error_of=error_of))
    finally:
        gateway.app.close()
    return 0


def _list(args: argparse.Namespace) -> int:
    gateway = _gateway("list")
    try:
        _print(list_tasks(gateway, args.tenant, args.state, args.limit))
    finally:
        gateway.app.close()
    return 0


def _result(args: argparse.Namespace) -> int:
    gateway = _gateway("result")
    try:
        task_status(gateway, args.task_id, args.tenant)      # TaskNotFound (exit 2) at once
        deadline = time.monotonic() + max(0.0, args.wait)
        while True:
            meta = gateway.app.backend.get_task_meta(args.task_id)
            if meta.get("status") in states.READY_STATES or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    finally:
        gateway.app.close()
    status = meta.get("status")
    if status == states.SUCCESS:
        _print(meta.get("result"))
        return 0
    if status in states.READY_STATES:
        _print({"task_id": args.task_id, "status": status, "error": error_of(meta)})
    else:
        _print({"task_id": args.task_id, "status": status, "ready": False})
    return 1


def register(subparsers: Any) -> None:
    """Add the ``task`` command (show, list, result, cancel) to the ``gateway`` CLI."""
    parser = subparsers.add_parser("task", help="a submitted task: show, list, result, cancel",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task_command", required=True)
    show = sub.add_parser("show", help="state, place in line, expected start, why it waits")
    show.add_argument("task_id", metavar="ID")
    show.add_argument("--tenant", default=None, help="only if TENANT submitted it (else exit 2)")
    show.set_defaults(func=_show)
    listing = sub.add_parser("list", help="a tenant's tasks, newest first")
    listing.add_argument("--tenant", required=True)
    listing.add_argument("--state", default=None, choices=STATES)
    listing.add_argument("--limit", type=int, default=50)
    listing.set_defaults(func=_list)
    result = sub.add_parser("result", help="a task's result (exit 1: failed or not ready)")
    result.add_argument("task_id", metavar="ID")
    result.add_argument("--tenant", default=None, help="only if TENANT submitted it (else exit 2)")
    result.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds")
    result.set_defaults(func=_result)
    cancel = sub.add_parser("cancel", help="cancel a queued or running task")
    cancel.add_argument("task_id", metavar="ID", help="the task id (from submit or POST /v1/tasks)")
    cancel.add_argument("--tenant", default=None,
                        help="only if TENANT submitted it (else: unknown task, exit 2)")
    cancel.set_defaults(func=_cancel)
