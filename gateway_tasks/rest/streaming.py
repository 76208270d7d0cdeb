"""``/v1/chat/completions`` with ``stream: true``: server-sent events through the queue.

The request is queued like any other (tier, fairness, bucket); the worker that
runs it publishes the upstream's chunks to the task's Redis stream
(``gateway_tasks.upstream.chunks``) and this process forwards them as they come,
in OpenAI's format (``data: <chat.completion.chunk>`` lines, then ``data:
[DONE]``), so the ``openai`` SDK's ``stream=True`` consumes the gateway like
the upstream.  The bucket is still settled from the upstream's final usage
(the worker always asks for it); the client gets the usage chunk only with
``stream_options: {"include_usage": true}``.

Errors before the response starts (auth, validation, queue full) are the usual
JSON errors with their status.  Once it has started (200), a failure is one
``data: {"error": {"type", "message"}}`` event and the stream ends: the task
failed (its error from the result backend), the stream broke mid-way, Redis
became unreachable (``ServiceUnavailable``, in the gateway's words), or no
chunk came within the wait (``deadline_s``, else 60 s, for the first; the
pool's timeout between two).  A task the upstream refused (a 4xx) sends the
upstream's own error object: ``data: {"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator

from celery import states
from celery.exceptions import BackendGetMetaError
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from gateway_tasks.upstream.chunks import CHUNK, DONE, ERROR, Event, read
from gateway_tasks.core.redis_failures import CLIENT_ERRORS, as_unavailable
from gateway_tasks.producer.gateway import Gateway, TaskHandle
from gateway_tasks.rest.errors import unavailable_message
from gateway_tasks.rest.results import error_of

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


def client_chunk(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any] | None:
    """The chunk as the client asked for it: without the usage unless include_usage (and
    the usage-only last chunk dropped then)."""
    if include_usage:
        return chunk
    if not chunk.get("choices") and chunk.get("usage") is not None:
        return None
    if chunk.get("usage") is not None:
        chunk = {**chunk, "usage": None}
    return chunk


def replay_chunks(result: Any, include_usage: bool) -> list[dict[str, Any]]:
    """A finished task's stored completion as chunks (role and text, finish, usage)."""
    body = (result or {}).get("response") if isinstance(result, dict) else None
    if not isinstance(body, dict):
        return []
    choice = (body.get("choices") or [{}])[0]
    text = ((choice.get("message") or {}).get("content")) or ""
    base = {"id": body.get("id", ""), "object": "chat.completion.chunk", "created": body.get("created", 0),
            "model": body.get("model", "")}
    out = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                 "finish_reason": None}]},
           {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason")}]}]
    if include_usage and body.get("usage") is not None:
        out.append({**base, "choices": [], "usage": body["usage"]})
    return out


def _error(type_: str, message: str, task_id: str) -> str:
    return sse({"error": {"type": type_, "message": message, "task_id": task_id}})


async def events(gateway: Gateway, task_id: str, include_usage: bool, first_timeout_s: float,
                 idle_timeout_s: float) -> AsyncIterator[str]:
    after = "0-0"
    started = last_seen = time.monotonic()
    got_chunk = False
    finished = False
    try:
        while True:
            batch: list[Event] = await run_in_threadpool(read, gateway.r, gateway.keys, task_id, after,
                                                         READ_BLOCK_MS)
            if not batch:
                meta = await run_in_threadpool(gateway.app.backend.get_task_meta, task_id)
                if meta.get("status") in states.EXCEPTION_STATES:
                    err = error_of(meta)
                    if isinstance(err.get("upstream"), dict):
                        yield sse({"error": err["upstream"]})
                    else:
                        yield _error(err["type"], f"task {task_id} failed: {err['message']}", task_id)
                    finished = True
                    return
                if meta.get("status") == states.SUCCESS and not got_chunk:
                    # done, and its stream already read or gone (an idempotent repeat, or a
                    # task submitted without stream): replay the stored result as chunks
                    for chunk in replay_chunks(meta.get("result"), include_usage):
                        yield sse(chunk)
                    yield sse("[DONE]")
                    return
                now = time.monotonic()
                if not got_chunk and now - started > first_timeout_s:
                    yield _error("Timeout", f"task {task_id} sent no chunk within {first_timeout_s:g} s; "
                                            "it is still queued or running", task_id)
                    return
                if got_chunk and now - last_seen > idle_timeout_s:
                    yield _error("Timeout", f"task {task_id} sent nothing for {idle_timeout_s:g} s",
                                 task_id)
                    return
                continue
            last_seen = time.monotonic()
            for event in batch:
                after = event.id
                if event.kind == CHUNK:
                    got_chunk = True
                    chunk = client_chunk(event.data, include_usage)
                    if chunk is not None:
                        yield sse(chunk)
                elif event.kind == DONE:
                    yield sse("[DONE]")
                    finished = True
                    return
                elif event.kind == ERROR:
                    if isinstance(event.data.get("upstream"), dict):   # the upstream's refusal, as sent
                        yield sse({"error": event.data["upstream"]})
                    else:
                        yield _error(str(event.data.get("type", "UpstreamError")),
                                     str(event.data.get("message", "")), task_id)
                    finished = True
                    return
    except (*CLIENT_ERRORS, OSError, BackendGetMetaError) as exc:
        # the status line is sent: the failure is the last event (the result backend's
        # reads give up, after their retries, with BackendGetMetaError)
        cause = exc.__cause__ if isinstance(exc, BackendGetMetaError) and exc.__cause__ else exc
        yield _error("ServiceUnavailable", unavailable_message(as_unavailable(cause)), task_id)
    except Exception:   # noqa: BLE001 -- whatever it is, the stream still ends with an event
        log.exception("stream of task %s failed", task_id)
        yield _error("InternalError", f"the gateway failed while streaming task {task_id}; "
                                      f"its result may still be read (GET /v1/tasks/{task_id})", task_id)
    finally:
        if finished:       # read to the end: the stream is no longer needed (it expires anyway)
            try:
                await run_in_threadpool(gateway.r.delete, gateway.keys.chunks(task_id))
            except (*CLIENT_ERRORS, OSError):
                log.warning("stream of task %s: its chunks were not deleted (Redis unavailable); "
                            "they expire with their TTL", task_id)


def streaming_response(gateway: Gateway, handle: TaskHandle, include_usage: bool,
                       first_timeout_s: float) -> StreamingResponse:
    idle_s = gateway.settings.pool_for_model(handle.model).timeout_s
    headers = {**SSE_HEADERS, "X-Gateway-Task-Id": handle.id, "X-Gateway-Tier": handle.tier}
    return StreamingResponse(events(gateway, handle.id, include_usage, first_timeout_s, idle_s),
                             media_type="text/event-stream", headers=headers)
