"""Task results stay out of logs and task events.

A gateway task's return value is the tenant's data (the upstream's completion).
Celery would put its repr, up to ``resultrepr_maxsize`` characters, into the
worker's INFO log line ``Task ...[id] succeeded in ...: <result>`` and into the
``task-succeeded`` event that Flower displays.  The result itself is kept where
it belongs -- the result backend, read by its owner through the API -- while:

* ``ResultHidingRequest`` (the gateway tasks' ``Request`` class) sends
  ``task-succeeded`` with ``RESULT_HIDDEN`` as the result, and answers
  ``inspect active / reserved / query_task`` with the arguments' summary only;
* ``HideTaskResults``, a logging filter on Celery's trace logger (installed by
  ``install_log_filter``, which ``workers.app`` calls), writes ``RESULT_HIDDEN``
  in place of the return value of a gateway task, and drops Celery's line of a
  gateway task's expected failure (its ``throws``: the task logs its own line,
  without the error's message -- an upstream's refusal may quote the request).

Arguments are already summarised (``InferenceRequest.argsrepr``: never the prompt).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.app.trace import log_policy_expected
from celery.worker.request import Request

RESULT_HIDDEN = "<hidden: the result is the tenant's data; read it by task id>"
TASK_PREFIX = "gateway."
TRACE_LOGGER = "celery.app.trace"


class ResultHidingRequest(Request):
    """A task request whose ``task-succeeded`` event never carries the result, and whose
    ``inspect active / reserved / query_task`` view always shows the arguments' summary
    (Celery shows the raw arguments -- the prompt -- unless asked for the safe view)."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        return super().info(safe=True)

    def send_event(self, type: str, **fields: Any) -> None:
        if type == "task-succeeded" and "result" in fields:
            fields["result"] = RESULT_HIDDEN
        super().send_event(type, **fields)


class HideTaskResults(logging.Filter):
    """Replaces the ``return_value`` of a gateway task in Celery's success log line; drops
    its line of a gateway task's expected failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, dict) or not str(args.get("name", "")).startswith(TASK_PREFIX):
            return True
        if args.get("description") == log_policy_expected.description:
            return False
        if "return_value" in args:
            record.args = {**args, "return_value": RESULT_HIDDEN}
        return True


def install_log_filter() -> None:
    """Add HideTaskResults to Celery's trace logger (once per process)."""
    logger = logging.getLogger(TRACE_LOGGER)
    if not any(isinstance(f, HideTaskResults) for f in logger.filters):
        logger.addFilter(HideTaskResults())
