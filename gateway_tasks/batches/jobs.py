"""Batches: create, read, list, cancel -- the OpenAI batch object over a Redis hash.

A batch's hash (``Keys.batch``) holds its OpenAI fields (status, the *_at times, file ids,
request counts) and the runner's cursor into its input file (``offset``: the byte where the
next line to submit starts; ``line``: its number).  ``gateway_tasks.batches.runner`` moves
it along: validating -> in_progress -> finalizing -> completed (or failed, expired,
cancelling -> cancelled).

``tenant_id`` in this module is a batch's owner: the tenant generation's tag
(``Tenant.owner_tag``), so a tenant id registered again never sees an earlier one's batches.

An input line is OpenAI's: ``{"custom_id", "method": "POST", "url", "body"}`` with the url
the batch's endpoint (/v1/chat/completions or /v1/embeddings).
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from gateway_tasks.batches.files import FileStore
from gateway_tasks.core.errors import InvalidRequest, TaskNotFound
from gateway_tasks.tenants.registry import tenant_of_tag

if TYPE_CHECKING:
    from gateway_tasks.producer.gateway import Gateway

ENDPOINTS = ("/v1/chat/completions", "/v1/embeddings")
COMPLETION_WINDOWS = {"24h": 86_400}
FINISHED = ("completed", "failed", "expired", "cancelled")
TIMES = ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")
MAX_METADATA_PAIRS = 16
LOCK_MS = 30_000        # a runner's step holds a batch this long at most
LOCK_POLL_S = 0.02
CANCEL_WAIT_S = 10.0    # a cancel waits this long at most for a step in progress


@dataclass(frozen=True)
class InputLine:
    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_line(text: str, number: int, endpoint: str) -> InputLine:
    """One input line, checked as OpenAI checks it; InvalidRequest naming what is wrong."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise InvalidRequest(f"line {number}: not valid JSON") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"line {number}: not a JSON object")
    custom_id, method, url, body = obj.get("custom_id"), obj.get("method"), obj.get("url"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest(f"line {number}: custom_id must be a non-empty string")
    if method != "POST":
        raise InvalidRequest(f"line {number}: method must be POST")
    if url != endpoint:
        raise InvalidRequest(f"line {number}: url {url!r} is not the batch's endpoint {endpoint!r}")
    if not isinstance(body, dict):
        raise InvalidRequest(f"line {number}: body must be an object")
    return InputLine(number, custom_id, url, body)


def validate_input(data: bytes, endpoint: str, max_lines: int) -> tuple[int, list[dict[str, Any]]]:
    """(lines, errors) of a whole input file: OpenAI's batch errors ``{code, message, line}``
    for malformed lines, duplicate custom ids, too many lines (the batch fails on any)."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    n = 0
    for raw in data.splitlines():
        if not raw.strip():
            continue
        n += 1
        if n > max_lines:
            errors.append({"code": "too_many_requests", "message": f"the file has more than {max_lines} requests",
                           "param": None, "line": n})
            break
        try:
            line = parse_line(raw.decode("utf-8"), n, endpoint)
        except (InvalidRequest, UnicodeDecodeError) as exc:
            errors.append({"code": "invalid_request", "message": str(exc), "param": None, "line": n})
        else:
            if line.custom_id in seen:
                errors.append({"code": "duplicate_custom_id", "param": "custom_id", "line": n,
                               "message": f"line {n}: custom_id {line.custom_id!r} is used twice"})
            seen.add(line.custom_id)
        if len(errors) >= 100:
            break
    if n == 0 and not errors:
        errors.append({"code": "empty_file", "message": "the input file holds no requests", "param": None,
                       "line": None})
    return n, errors


def create_batch(gw: "Gateway", tenant_id: str, input_file_id: str, endpoint: str, completion_window: str,
                 metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """A new batch, validating (the runner checks its file and starts it)."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}")
    if completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequest(f"completion_window must be one of {list(COMPLETION_WINDOWS)}, "
                             f"got {completion_window!r}")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS
                                 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise InvalidRequest(f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs")
    files = FileStore(gw)
    source = files.get(tenant_id, input_file_id)
    if source["purpose"] != "batch":
        raise InvalidRequest(f"file {input_file_id} has purpose {source['purpose']!r}, not 'batch'")
    batch_id = f"batch_{uuid.uuid4().hex}"
    now = int(time.time())
    fields = {"id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
              "completion_window": completion_window, "status": "validating", "created_at": now,
              "expires_at": now + COMPLETION_WINDOWS[completion_window], "total": 0, "completed": 0,
              "failed": 0, "offset": 0, "line": 0, "metadata": json.dumps(metadata) if metadata else "",
              "output_file_id": "", "error_file_id": "", "errors": ""}
    with gw.r.pipeline(transaction=False) as pipe:
        pipe.hset(gw.keys.batch(tenant_id, batch_id), mapping=fields)
        pipe.zadd(gw.keys.batches(tenant_id), {batch_id: now})
        pipe.sadd(gw.keys.batches_active, f"{tenant_id}|{batch_id}")
        pipe.execute()
    return batch_object(read_fields(gw, tenant_id, batch_id))


def read_fields(gw: "Gateway", tenant_id: str, batch_id: str) -> dict[str, str]:
    raw = gw.r.hgetall(gw.keys.batch(tenant_id, batch_id)) if batch_id.startswith("batch_") else {}
    if not raw:
        raise TaskNotFound(f"no batch {batch_id!r} for this tenant")
    return {k.decode(): v.decode() for k, v in raw.items()}


def batch_object(f: dict[str, str]) -> dict[str, Any]:
    """OpenAI's batch object from a batch's hash."""
    num = lambda name: int(f[name]) if f.get(name) else None  # noqa: E731
    errors = json.loads(f["errors"]) if f.get("errors") else None
    return {"id": f["id"], "object": "batch", "endpoint": f["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": f["input_file_id"], "completion_window": f["completion_window"],
            "status": f["status"], "output_file_id": f.get("output_file_id") or None,
            "error_file_id": f.get("error_file_id") or None, "created_at": num("created_at"),
            **{name: num(name) for name in TIMES},
            "request_counts": {"total": num("total") or 0, "completed": num("completed") or 0,
                               "failed": num("failed") or 0},
            "metadata": json.loads(f["metadata"]) if f.get("metadata") else None}


def get_batch(gw: "Gateway", tenant_id: str, batch_id: str) -> dict[str, Any]:
    return batch_object(read_fields(gw, tenant_id, batch_id))


def list_batches(gw: "Gateway", tenant_id: str, limit: int = 20, after: str | None = None) -> dict[str, Any]:
    """The tenant's batches, newest first, OpenAI's cursor page (``after``: a batch id)."""
    ids = [i.decode() for i in gw.r.zrevrange(gw.keys.batches(tenant_id), 0, -1)]
    if after is not None and after in ids:
        ids = ids[ids.index(after) + 1:]
    page = []
    for batch_id in ids[:limit + 1]:
        try:
            page.append(get_batch(gw, tenant_id, batch_id))
        except TaskNotFound:
            continue
    more = len(page) > limit
    page = page[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": more}


@contextmanager
def batch_locked(gw: "Gateway", tenant_id: str, batch_id: str, wait_s: float = 0.0) -> Iterator[bool]:
    """Hold a batch's lock (``Keys.batch_lock``, LOCK_MS at most) while the block runs; yields
    whether it was taken within ``wait_s``.  The runner's steps take it without waiting, a
    cancel waits for a step in progress, so no line is submitted after the cancel's sweep."""
    key, token = gw.keys.batch_lock(tenant_id, batch_id), uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    taken = bool(gw.r.set(key, token, nx=True, px=LOCK_MS))
    while not taken and time.monotonic() < deadline:
        time.sleep(LOCK_POLL_S)
        taken = bool(gw.r.set(key, token, nx=True, px=LOCK_MS))
    try:
        yield taken
    finally:
        if taken and gw.r.get(key) == token.encode():
            gw.r.delete(key)


def cancel_batch(gw: "Gateway", tenant_id: str, batch_id: str) -> dict[str, Any]:
    """Stop a batch at once: cancelling, its queued lines cancelled now (they never reach the
    upstream); the runner collects what finished and ends it as cancelled.  It waits for a
    runner's step in progress (``batch_locked``), which may be submitting lines."""
    f = read_fields(gw, tenant_id, batch_id)
    if f["status"] in FINISHED or f["status"] == "cancelling":
        return batch_object(f)
    with batch_locked(gw, tenant_id, batch_id, wait_s=CANCEL_WAIT_S):
        gw.r.hset(gw.keys.batch(tenant_id, batch_id), mapping={"status": "cancelling",
                                                               "cancelling_at": int(time.time())})
        cancel_in_flight(gw, tenant_id, batch_id)
    return get_batch(gw, tenant_id, batch_id)


def cancel_in_flight(gw: "Gateway", tenant_id: str, batch_id: str) -> int:
    """Cancel every submitted, uncollected line's task; how many were still queued or running."""
    stopped = 0
    for raw in gw.r.hvals(gw.keys.batch_inflight(tenant_id, batch_id)):
        task_id = json.loads(raw)["task"]
        try:
            done = gw.cancel(task_id, tenant_of_tag(tenant_id))
        except InvalidRequest:     # the task's record is gone: nothing left to stop
            continue
        stopped += done.was in ("queued", "waiting", "running", "gone")
    return stopped
