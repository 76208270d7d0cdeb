"""Dead letters: a message on a gateway queue that no worker can run.

Anything with Redis access can put a message on a queue -- a buggy producer, a
tool, an attacker -- and the worker must survive it.  Before a picked message is
handed to Celery, ``problem_of`` checks what the worker relies on: a JSON kombu
envelope (JSON content only, never pickle), the Celery task headers of a
gateway task, a decodable ``[args, kwargs, embed]`` body, and a token estimate
the pool's bucket can hold that matches what pick.lua debited.  A message that
fails is ``DeadLetterer``-ed: released (its tenant's slot freed, gone from the
queue), its tokens and request slot given back to the bucket, recorded with the
reason at the head of the pool's dead-letter list (``Keys.dead_letters``, the
newest ``DEAD_LETTERS_KEPT``), counted (``dead_lettered:<tier>``), and, when it
names a task id, that task fails with ``DeadLettered`` and the reason.  Logs
carry the tag, queue and reason, never the message's content.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from datetime import datetime
from typing import Any, Callable

import redis

from gateway_tasks.core.errors import DeadLettered
from gateway_tasks.core.keys import Keys
from gateway_tasks.dispatch.request import HEADER_EST_TOKENS, HEADER_TENANT
from gateway_tasks.core.scripts import Scripts
from gateway_tasks.core.settings import Settings
from gateway_tasks.core.stats import DEAD_LETTERED, tier_field
from gateway_tasks.bucket.pool_bucket import PoolBucket
from gateway_tasks.dispatch.release import ACK, ReleaseCall
from gateway_tasks.dispatch.router import Picked

logger = logging.getLogger(__name__)

TASK_PREFIX = "gateway."         # gateway queues carry gateway tasks only
JSON_CONTENT = "application/json"
ENCODINGS = ("utf-8", "utf8")

_STR = (str,)
_OPT_STR = (str, type(None))
_INT = (int,)
_OPT_INT = (int, type(None))
_NUM = (int, float)
# the types Celery (task protocol 2) and the gateway read from a message's headers;
# anything else in a known header would break Celery outside the task (a dead worker)
HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "lang": _STR, "task": _STR, "id": _STR, "shadow": _OPT_STR, "eta": _OPT_STR, "expires": _OPT_STR,
    "group": _OPT_STR, "group_index": _OPT_INT, "retries": _INT, "timelimit": (list,),
    "root_id": _OPT_STR, "parent_id": _OPT_STR, "argsrepr": _OPT_STR, "kwargsrepr": _OPT_STR,
    "origin": _OPT_STR, "ignore_result": (bool, type(None)), "replaced_task_nesting": _INT,
    "stamped_headers": (list, type(None)), "stamps": (dict, type(None)),
    "gt_tenant": _STR, "gt_tier": _STR, "gt_source": _STR, "gt_weight": _NUM,
}
PROPERTY_TYPES: dict[str, tuple[type, ...]] = {
    "delivery_info": (dict,), "body_encoding": _STR, "priority": _OPT_INT, "delivery_mode": _OPT_INT,
    "correlation_id": _OPT_STR, "reply_to": _OPT_STR,
}

# The dead-letter records of a pool (``Keys.dead_letters``): written by ``DeadLetterer``,
# read by operators (``gateway dead-letters``: ``dead_letters``) and tests.
# A record is JSON: ``tag``, ``queue``, ``tenant``, ``tier``, ``task_id`` ('' when
# the message names none), ``reason``, ``at_ms``, ``message`` (its first
# ``RAW_KEPT_CHARS`` characters) and ``message_chars``.  The list keeps the
# newest ``DEAD_LETTERS_KEPT``, newest first.
DEAD_LETTERS_KEPT = 1000
RAW_KEPT_CHARS = 65_536


def dead_letters(client: redis.Redis, keys: Keys, pool: str, count: int = 100) -> list[dict[str, Any]]:
    """The newest ``count`` dead-letter records of a pool."""
    return [json.loads(x) for x in client.lrange(keys.dead_letters(pool), 0, max(0, count - 1))]


def _typed(values: dict[str, Any], types: dict[str, tuple[type, ...]], where: str) -> str | None:
    for name, allowed in types.items():
        if name not in values:
            continue
        value = values[name]
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            return f"{where} {name!r} has a {type(value).__name__}, not {'/'.join(t.__name__ for t in allowed)}"
    return None


def _header_values_problem(headers: dict[str, Any]) -> str | None:
    for name in ("eta", "expires"):
        value = headers.get(name)
        if isinstance(value, str):
            try:
                datetime.fromisoformat(value)
            except ValueError:
                return f"header {name!r} is not an ISO 8601 time"
    limits = headers.get("timelimit")
    if limits is not None and not (len(limits) == 2 and all(
            x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0) for x in limits)):
        return "header 'timelimit' is not [soft, hard] seconds"
    if headers.get("retries", 0) < 0 or headers.get("replaced_task_nesting", 0) < 0:
        return "header 'retries' or 'replaced_task_nesting' is negative"
    weight = headers.get("gt_weight", 1)
    if not (0 < weight < float("inf")):
        return "header 'gt_weight' is not a positive number"
    return None


def _body_problem(body: Any, encoding: Any) -> str | None:
    if not isinstance(body, str):
        return "the message body is not a string"
    try:
        raw = base64.b64decode(body, validate=True) if encoding == "base64" else body.encode()
        decoded = json.loads(raw)
    except (binascii.Error, ValueError):
        return "the message body is not JSON"
    if not (isinstance(decoded, list) and len(decoded) == 3 and isinstance(decoded[0], list)
            and isinstance(decoded[1], dict) and isinstance(decoded[2], (dict, type(None)))):
        return "the message body is not a Celery [args, kwargs, embed] triple"
    return None


def _est_problem(headers: dict[str, Any], picked: Picked, capacity: float, stale: bool) -> str | None:
    est = headers.get(HEADER_EST_TOKENS)
    if isinstance(est, bool) or not isinstance(est, (int, float)) or est != est or est < 0:
        return f"header {HEADER_EST_TOKENS} is not a non-negative number"
    if est > capacity:
        return (f"est_tokens {est:.0f} is over the pool's bucket capacity ({capacity:.0f} tokens): "
                f"it could never be admitted")
    if int(est) != picked.est_tokens and not stale:   # a stale dispatch took no tokens: 0
        return (f"est_tokens {est:.0f} of the message does not match its queue entry's "
                f"{picked.est_tokens}")
    return None


def problem_of(picked: Picked, settings: Settings) -> str | None:
    """Why a picked message cannot be run (None: it can be handed to Celery)."""
    if picked.undecodable:
        return "the message is not a JSON object"
    message = picked.payload
    headers, properties = message.get("headers"), message.get("properties")
    if not isinstance(properties, dict) or "body" not in message:
        return "not a kombu message envelope (needs body, headers, properties)"
    if message.get("content-type") != JSON_CONTENT:
        return f"content type {str(message.get('content-type'))[:64]!r} refused: JSON only"
    encoding = message.get("content-encoding", "utf-8")
    if not isinstance(encoding, str) or encoding.lower() not in ENCODINGS:
        return f"content encoding {str(encoding)[:32]!r} refused: UTF-8 only"
    if properties.get("delivery_tag") != picked.tag or not isinstance(properties.get("delivery_info"), dict):
        return "the message's delivery properties do not match its queue entry"
    if not isinstance(headers, dict):
        return "the message headers are not an object"
    problem = (_typed(headers, HEADER_TYPES, "header") or _typed(properties, PROPERTY_TYPES, "property")
               or _header_values_problem(headers))
    if problem:
        return problem
    if headers.get(HEADER_TENANT, picked.tenant) != picked.tenant:
        return "header gt_tenant does not match its queue entry's tenant"
    task, task_id = headers.get("task"), headers.get("id")
    if not (isinstance(task, str) and task.startswith(TASK_PREFIX) and isinstance(task_id, str)
            and task_id):
        return f"lacks the Celery task headers 'task' (a {TASK_PREFIX}* task) and 'id'"
    body_problem = _body_problem(message.get("body"), properties.get("body_encoding"))
    if body_problem:
        return body_problem
    return _est_problem(headers, picked, settings.pool(picked.pool).token_capacity, picked.stale)


def _task_id(picked: Picked) -> str:
    task_id = (picked.payload.get("headers") or {}).get("id")
    return task_id if isinstance(task_id, str) and 0 < len(task_id) <= 256 else ""


class DeadLetterer:
    """Takes one picked message off its queue for good, with the reason."""

    def __init__(self, client: redis.Redis, scripts: Scripts, keys: Keys, settings: Settings,
                 mark_failed: Callable[[str, BaseException], None] | None = None):
        self.r = client
        self.scripts = scripts
        self.keys = keys
        self.settings = settings
        self.mark_failed = mark_failed

    def __call__(self, picked: Picked, reason: str) -> None:
        done = self.scripts.run(ReleaseCall(self.keys, self.settings, picked.pool, picked.tag, ACK,
                                            str(picked.dispatched_ms)))
        if not done.released:   # another worker holds it now (this dispatch's lease expired)
            return
        pool = self.settings.pool(picked.pool)
        PoolBucket(self.r, self.keys, pool).settle(
            est_tokens=picked.est_tokens, actual_tokens=0, tier=picked.tier, tenant_id=picked.tenant,
            model="", completion_tokens=0, learn=False, reached_upstream=False)
        task_id = _task_id(picked)
        raw = picked.undecodable or json.dumps(picked.payload)
        record = {"tag": picked.tag, "queue": picked.queue, "tenant": picked.tenant, "tier": picked.tier,
                  "task_id": task_id, "reason": reason, "at_ms": int(time.time() * 1000),
                  "message": raw[:RAW_KEPT_CHARS], "message_chars": len(raw)}
        key = self.keys.dead_letters(pool.name)
        with self.r.pipeline(transaction=True) as pipe:      # the pool's slot
            pipe.lpush(key, json.dumps(record))
            pipe.ltrim(key, 0, DEAD_LETTERS_KEPT - 1)
            pipe.hincrby(self.keys.stats(pool.name), tier_field(DEAD_LETTERED, picked.tier), 1)
            pipe.execute()
        logger.error("dead-lettered message %s on %s (task %s): %s", picked.tag, picked.queue,
                     task_id or "-", reason)
        if task_id and self.mark_failed is not None:
            try:
                self.mark_failed(task_id, DeadLettered(f"the task's message was dead-lettered: {reason}"))
            except Exception:  # noqa: BLE001 -- the record above is kept whatever the backend does
                logger.warning("could not store the failure of dead-lettered task %s", task_id,
                               exc_info=True)


__all__ = ["DeadLetterer", "dead_letters", "problem_of"]
