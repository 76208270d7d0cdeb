"""`gateway task cancel ID`: cancel a task (an operator's command: any tenant's task,
or only TENANT's with --tenant).

A queued task is removed at once and never reaches the upstream; a running one is
revoked and its result discarded.  Prints JSON {task_id, cancelled, was, status};
exit status 0 when it was cancelled (now or before), 1 when it had already finished,
2 for an unknown task id.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gateway_tasks.core.settings import get_settings
from gateway_tasks.producer.gateway import Gateway


def _cancel(args: argparse.Namespace) -> int:
    settings = get_settings()
    settings.require_redis_url("`gateway task cancel`")
    gateway = Gateway(settings)
    try:
        done = gateway.cancel(args.task_id, args.tenant)
    finally:
        gateway.app.close()
    json.dump({"task_id": done.task_id, "cancelled": done.cancelled, "was": done.was, "status": done.status},
              sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if done.cancelled else 1


def register(subparsers: Any) -> None:
    """Add the ``task`` command (cancel) to the ``gateway`` CLI."""
    parser = subparsers.add_parser("task", help="act on a submitted task (cancel)", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task_command", required=True)
    cancel = sub.add_parser("cancel", help="cancel a queued or running task")
    cancel.add_argument("task_id", metavar="ID", help="the task id (from submit or POST /v1/tasks)")
    cancel.add_argument("--tenant", default=None,
                        help="only if TENANT submitted it (else: unknown task, exit 2)")
    cancel.set_defaults(func=_cancel)
