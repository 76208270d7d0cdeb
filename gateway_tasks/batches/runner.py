"""The batch runner: moves every active batch along, a few hundred lines at a time.

    BatchRunner(gw).start()     # a daemon thread (the API process runs one: gateway_tasks.rest.app)
    advance(gw, tenant, batch)  # one step of one batch (tests call it directly)

Each step of a batch, under its lock (``jobs.batch_locked``; several API replicas share the work):

1. validating: the whole input file checked (``jobs.validate_input``); any error fails the
   batch with OpenAI's ``errors``; else in_progress with its ``request_counts.total``;
2. collect: the submitted lines whose tasks finished go to the output file (a served
   answer) or the error file (the upstream's refusal with its status and error object,
   or the gateway's error), request_counts updated;
3. submit: lines read from the input file's cursor and submitted as the tenant's work --
   its tier or ``batch_tier`` when lower, the scheduled lane, its TPM quota (not its
   hourly task count) -- until ``batch_lines_in_flight`` are in flight.  A refusal for now
   (queue full, quota spent, deferred) leaves the line for the next step; a request the
   gateway refuses outright (unknown model, too large) is a failed line;
4. cancelling or past ``expires_at``: lines still in flight are cancelled (queued ones never
   reach the upstream); expired lines go to the error file as ``batch_expired``;
5. when every line is collected: finalizing, the output and error files indexed, then
   completed (cancelled, expired).

A batch is keyed by its owner, the tenant generation's tag (``Tenant.owner_tag``: '<tenant>/<gen>');
its lines are submitted as that tenant.

Memory stays bounded: at most ``batch_lines_in_flight`` lines of a batch are in Redis at
once, and the input is read from its cursor, never whole (but once, to validate it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from gateway_tasks.batches.files import FileStore, batch_dir_of, new_file_id
from gateway_tasks.batches.jobs import (FINISHED, InputLine, batch_locked, cancel_in_flight, parse_line, read_fields,
                                        validate_input)
from gateway_tasks.core.errors import GatewayError, InvalidRequest, RedisUnavailable, Rejected
from gateway_tasks.dispatch.lanes import SCHEDULED
from gateway_tasks.dispatch.request import CHAT, EMBEDDINGS
from gateway_tasks.tenants.registry import tenant_of_tag

if TYPE_CHECKING:
    from gateway_tasks.producer.gateway import Gateway

logger = logging.getLogger(__name__)
TICK_S = 0.2
BATCH_SOURCE = "batch"
_CHAT_OWN = {"messages", "model", "max_tokens", "max_completion_tokens", "stream", "stream_options"}
_EMBEDDINGS_OWN = {"input", "model"}
# HTTP status of a line's failure when the error is the gateway's, not the upstream's
_STATUS = {"DeadlineExceeded": 504, "Expired": 504, "RetryBudgetExceeded": 429, "QueueFull": 429,
           "Evicted": 429, "QuotaExceeded": 429, "Deferred": 429, "TaskCancelled": 499}


class BatchRunner:
    """A daemon thread advancing every active batch every TICK_S."""

    def __init__(self, gw: "Gateway", tick_s: float = TICK_S):
        self.gw, self.tick_s = gw, tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-runner", daemon=True)

    def start(self) -> "BatchRunner":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for member in self.gw.r.smembers(self.gw.keys.batches_active):
                    tenant_id, _, batch_id = member.decode().partition("|")
                    advance(self.gw, tenant_id, batch_id)
            except (redis.RedisError, OSError, GatewayError) as exc:
                logger.warning("batch runner: %s: %s", type(exc).__name__, exc)
            self._stop.wait(self.tick_s)


def advance(gw: "Gateway", tenant_id: str, batch_id: str) -> str:
    """One step of a batch (module doc); returns its status after it ('' when another runner,
    or a cancel, holds it)."""
    with batch_locked(gw, tenant_id, batch_id) as taken:
        return _Step(gw, tenant_id, batch_id).run() if taken else ""


class _Step:
    def __init__(self, gw: "Gateway", tenant_id: str, batch_id: str):
        self.gw, self.tenant_id, self.batch_id = gw, tenant_id, batch_id
        self.key = gw.keys.batch(tenant_id, batch_id)
        self.inflight = gw.keys.batch_inflight(tenant_id, batch_id)
        self.f = read_fields(gw, tenant_id, batch_id)
        self.dir = batch_dir_of(gw)

    def run(self) -> str:
        status = self.f["status"]
        if status in FINISHED:
            self.gw.r.srem(self.gw.keys.batches_active, f"{self.tenant_id}|{self.batch_id}")
            return status
        if status == "validating":
            status = self._validate()
            if status == "failed":
                return status
        expired = int(time.time()) >= int(self.f["expires_at"])
        if status == "cancelling" or expired:
            cancel_in_flight(self.gw, self.tenant_id, self.batch_id)
        self._collect(ending=status == "cancelling" or expired)
        if status == "in_progress" and not expired:
            self._submit()
        if expired and status == "in_progress":
            self._expire_rest()
        if self.gw.r.hlen(self.inflight) == 0 and (status != "in_progress" or expired or self._input_done()):
            return self._finish("expired" if expired and status == "in_progress" else
                                "cancelled" if status == "cancelling" else "completed")
        return status

    # -- validating -------------------------------------------------------------------------
    def _validate(self) -> str:
        path = self.dir / self.f["input_file_id"]
        lines, errors = validate_input(path.read_bytes(), self.f["endpoint"], self.gw.settings.batch_max_lines)
        now = int(time.time())
        if errors:
            self._set(status="failed", failed_at=now, errors=json.dumps(errors))
            self.gw.r.srem(self.gw.keys.batches_active, f"{self.tenant_id}|{self.batch_id}")
            return "failed"
        self._set(status="in_progress", in_progress_at=now, total=lines, output_file_id=new_file_id(),
                  error_file_id=new_file_id())
        return "in_progress"

    # -- collect ----------------------------------------------------------------------------
    def _collect(self, ending: bool) -> None:
        entries = {int(k): json.loads(v) for k, v in self.gw.r.hgetall(self.inflight).items()}
        if not entries:
            return
        numbers = sorted(entries)
        with self.gw.r.pipeline(transaction=False) as pipe:    # one key each: one slot each on a cluster
            for n in numbers:
                pipe.get(self.gw.keys.result(entries[n]["task"]))
            metas = pipe.execute()
        out, err, done, completed, failed = [], [], [], 0, 0
        for n, raw in zip(numbers, metas):
            meta = json.loads(raw) if raw else {}
            status = meta.get("status")
            entry = entries[n]
            if status == "SUCCESS":
                out.append(_output_line(entry, 200, meta["result"]["response"]))
                completed += 1
            elif status in ("FAILURE", "REVOKED"):
                code, body = _failure(meta.get("result"))
                if code == 499 and ending:          # cancelled with the batch: not a failed request
                    done.append(n)
                    continue
                err.append(_output_line(entry, code, body))
                failed += 1
            else:
                continue
            done.append(n)
        self._append("output_file_id", out)
        self._append("error_file_id", err)
        if done:
            with self.gw.r.pipeline(transaction=False) as pipe:
                pipe.hdel(self.inflight, *done)
                pipe.hincrby(self.key, "completed", completed)
                pipe.hincrby(self.key, "failed", failed)
                pipe.execute()

    # -- submit -----------------------------------------------------------------------------
    def _submit(self) -> None:
        room = self.gw.settings.batch_lines_in_flight - self.gw.r.hlen(self.inflight)
        if room <= 0:
            return
        offset, number = int(self.f["offset"]), int(self.f["line"])
        submitted: dict[int, str] = {}
        errors = []
        with open(self.dir / self.f["input_file_id"], "rb") as fh:
            fh.seek(offset)
            while room > 0:
                raw = fh.readline()
                if not raw:
                    break
                if not raw.strip():
                    offset += len(raw)
                    continue
                line = parse_line(raw.decode("utf-8"), number + 1, self.f["endpoint"])
                try:
                    task_id = self._submit_line(line)
                except (Rejected, RedisUnavailable):
                    break     # not now (queue full, quota spent, deferred, Redis full): again next step
                except InvalidRequest as exc:
                    errors.append(_output_line({"custom_id": line.custom_id, "task": f"line-{line.number}"},
                                               400, {"error": {"message": str(exc), "type": type(exc).__name__,
                                                               "param": None, "code": "invalid_request"}}))
                else:
                    submitted[line.number] = json.dumps({"task": task_id, "custom_id": line.custom_id})
                    room -= 1
                offset += len(raw)
                number += 1
        self._append("error_file_id", errors)
        with self.gw.r.pipeline(transaction=False) as pipe:
            if submitted:
                pipe.hset(self.inflight, mapping=submitted)
            if errors:
                pipe.hincrby(self.key, "failed", len(errors))
            pipe.hset(self.key, mapping={"offset": offset, "line": number})
            pipe.execute()
        self.f.update(offset=str(offset), line=str(number))

    def _submit_line(self, line: InputLine) -> str:
        body = line.body
        common = dict(source=BATCH_SOURCE, lane=SCHEDULED, count_quota=False, tier=self.gw.settings.batch_lines_tier,
                      idempotency_key=f"{self.batch_id}:{line.number}")
        if self.f["endpoint"] == "/v1/embeddings":
            extra = {k: v for k, v in body.items() if k not in _EMBEDDINGS_OWN}
            handle = self.gw.submit(tenant_of_tag(self.tenant_id), body.get("input"), model=body.get("model"),
                                    extra_body=extra or None, endpoint=EMBEDDINGS, **common)
        else:
            if body.get("stream"):
                raise InvalidRequest("stream is not supported in a batch")
            extra = {k: v for k, v in body.items() if k not in _CHAT_OWN}
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
            handle = self.gw.submit(tenant_of_tag(self.tenant_id), body.get("messages"), model=body.get("model"),
                                    max_tokens=max_tokens, extra_body=extra or None, endpoint=CHAT, **common)
        return handle.id

    def _input_done(self) -> bool:
        return int(self.f["offset"]) >= (self.dir / self.f["input_file_id"]).stat().st_size

    def _expire_rest(self) -> None:
        """Past the completion window: every line not submitted goes to the error file."""
        errors = []
        with open(self.dir / self.f["input_file_id"], "rb") as fh:
            fh.seek(int(self.f["offset"]))
            number = int(self.f["line"])
            for raw in fh:
                if not raw.strip():
                    continue
                number += 1
                line = parse_line(raw.decode("utf-8"), number, self.f["endpoint"])
                errors.append({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None,
                               "error": {"code": "batch_expired",
                                         "message": "This request could not be executed before the completion "
                                                    "window expired."}})
        self._append("error_file_id", errors)
        size = (self.dir / self.f["input_file_id"]).stat().st_size
        self._set(offset=size, line=int(self.f["line"]) + len(errors))

    # -- finish -----------------------------------------------------------------------------
    def _finish(self, status: str) -> str:
        now = int(time.time())
        self._set(status="finalizing", finalizing_at=now)
        files = FileStore(self.gw)
        ids = {}
        for field in ("output_file_id", "error_file_id"):
            file_id = self.f.get(field, "")
            if file_id and (self.dir / file_id).exists():
                files.register_output(self.tenant_id, file_id, f"{self.batch_id}_{field[:-8]}.jsonl")
                ids[field] = file_id
            else:
                ids[field] = ""
        self._set(status=status, **{f"{status}_at": int(time.time())}, **ids)
        self.gw.r.srem(self.gw.keys.batches_active, f"{self.tenant_id}|{self.batch_id}")
        return status

    # -- helpers ----------------------------------------------------------------------------
    def _set(self, **fields: Any) -> None:
        self.gw.r.hset(self.key, mapping=fields)
        self.f.update({k: str(v) for k, v in fields.items()})

    def _append(self, field: str, lines: list[dict[str, Any]]) -> None:
        if not lines:
            return
        path: Path = self.dir / self.f[field]
        with open(path, "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))


def _output_line(entry: dict[str, Any], status: int, body: dict[str, Any]) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's format."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": entry["custom_id"],
            "response": {"status_code": status, "request_id": entry["task"], "body": body}, "error": None}


def _failure(exc: Any) -> tuple[int, dict[str, Any]]:
    """A failed line's HTTP status and OpenAI error body, from its task's stored exception
    (Celery's JSON form: exc_type, exc_message = the error's args)."""
    if not isinstance(exc, dict):
        return 500, {"error": {"message": "the task failed", "type": "server_error", "param": None, "code": None}}
    kind = str(exc.get("exc_type", "TaskFailed"))
    args = exc.get("exc_message")
    args = list(args) if isinstance(args, (list, tuple)) else [args]
    message = str(args[0]) if args else kind
    if kind == "UpstreamRejected" and len(args) >= 8:     # (message, retry, reason, status, msg, type, param, code)
        return int(args[3]), {"error": {"message": args[4], "type": args[5], "param": args[6], "code": args[7]}}
    return _STATUS.get(kind, 500), {"error": {"message": message, "type": kind, "param": None, "code": None}}
