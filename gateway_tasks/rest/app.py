"""The REST trigger: submit tasks over HTTP, read their results, and an
OpenAI-compatible synchronous endpoint so the openai SDK can point at the gateway.

    POST /v1/tasks              202 {task_id, tier, queue, model, prompt_tokens, est_tokens, status_url[,
                                deferred: {deferred_until, reason, message, ...}]}; 429 Deferred when
                                the caller asked for a refusal (on_defer / X-Gateway-On-Defer: refuse)
    GET  /v1/tasks/{task_id}    {task_id, status, result? | error?}  (own tasks only)
    DELETE /v1/tasks/{task_id}  cancel it: 200 queued (removed) / 202 running (revoked) / 409 finished
    POST/GET/DELETE /v1/crons   the tenant's own crons (gateway_tasks.rest.crons)
    POST /v1/chat/completions   submit, wait, return the upstream body as-is (stream=true: SSE chunks);
                                the upstream's 4xx (not 429) with its status and OpenAI error object
    POST /v1/embeddings         the same for embeddings (the input's tokens, no completion reserve)
    GET  /v1/models             what the calling tenant may use (gateway_tasks.rest.openai_models)
    GET  /v1/usage              the tenant's usage per hour and day (gateway_tasks.rest.usage)
    /v1/files, /v1/batches      the OpenAI Batch API (gateway_tasks.rest.batches)
    GET  /v1/status             the load level, its reason and history, pools' circuits
    GET  /healthz               Redis ping (no credential)
    GET  /metrics               Prometheus text (gateway_tasks.metrics.exporter; admin credential)
    /v1/admin/...               tenants and settings (gateway_tasks.rest.admin; admin credential)

Every request but /healthz and the OpenAPI pages authenticates first
(gateway_tasks.rest.auth: ``Authorization: Bearer <tenant api key>``, or the
admin credential for /v1/admin and /metrics), then its body is limited to
settings.max_request_bytes (gateway_tasks.rest.limits), then it is parsed
(gateway_tasks.rest.models).  Errors are JSON ``{"error": {"type", "message"}}``
(gateway_tasks.rest.errors).  ``gateway api`` serves it (gateway_tasks.rest.cli).
"""

from __future__ import annotations

from typing import Any, Callable

import redis
from celery import states
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from gateway_tasks.core.errors import ApiError, InvalidRequest, UnknownTask
from gateway_tasks.overload.status import deployment_status
from gateway_tasks.metrics.exporter import CONTENT_TYPE, render
from gateway_tasks.producer.gateway import FINISHED, Gateway
from gateway_tasks.rest.admin import admin_router
from gateway_tasks.rest.auth import AdminDep, AuthMiddleware, TenantDep
from gateway_tasks.tenants.auth_cache import AuthCache
from gateway_tasks.rest.crons import router as crons_router
from gateway_tasks.rest.openai_models import router as openai_router
from gateway_tasks.rest.usage import router as usage_router
from gateway_tasks.rest.batches import router as batches_router
from gateway_tasks.batches.runner import BatchRunner
from gateway_tasks.rest.errors import error_body, install_error_handlers, retry_after_header
from gateway_tasks.rest.limits import BodySizeLimit
from gateway_tasks.rest.openapi import install_openapi
from gateway_tasks.rest.models import ChatCompletionRequest, EmbeddingRequest, TaskRequest
from gateway_tasks.dispatch.request import EMBEDDINGS
from gateway_tasks.rest.result_waiter import ResultWaiter, waiter_for
from gateway_tasks.rest.results import error_of, task_view
from gateway_tasks.rest.streaming import streaming_response
from gateway_tasks.core.tokens import encoding

# how long the synchronous endpoint waits at most: below the 60 s most proxies and clients
# give up at; a client that says its own timeout (the openai SDK's X-Stainless-Timeout) or
# a deadline_s is waited for that long, less a margin to answer before it gives up
DEFAULT_SYNC_TIMEOUT_S = 30.0
ON_DEFER_HEADER = "X-Gateway-On-Defer"
CLIENT_TIMEOUT_HEADERS = ("X-Gateway-Timeout", "X-Stainless-Timeout")
CLIENT_TIMEOUT_MARGIN_S = 0.5
UPLOAD_FRAMING_B = 65_536   # a multipart upload's headers and boundaries, beyond the file itself


def _status_url(request: Request, task_id: str) -> str:
    """The task's status path (relative: correct behind any proxy; includes root_path)."""
    return request.url_for("get_task", task_id=task_id).path


def _failure_status(error: dict[str, Any]) -> int:
    if error["type"] in ("DeadlineExceeded", "Expired"):
        return 504
    if error["type"] in ("QueueFull", "Evicted", "QuotaExceeded"):
        return 429
    if error["type"] == "TaskCancelled":
        return 409
    return 502


def sync_timeout_s(deadline_s: float | None, headers: Any) -> float:
    """How long /v1/chat/completions waits: the deadline, else the default, and never past
    a timeout the client announces (less a margin, so it gets the answer before it leaves)."""
    timeout_s = deadline_s or DEFAULT_SYNC_TIMEOUT_S
    for name in CLIENT_TIMEOUT_HEADERS:
        try:
            announced = float(headers.get(name) or "nan")
        except ValueError:
            continue
        if announced > 0:
            timeout_s = min(timeout_s, max(CLIENT_TIMEOUT_MARGIN_S, announced - CLIENT_TIMEOUT_MARGIN_S))
    return timeout_s


def result_waiter(gateway: Gateway) -> ResultWaiter:
    """This process's (and event loop's) result waiter (gateway_tasks.rest.result_waiter)."""
    return waiter_for(gateway.app.backend, gateway.settings.redis_url, gateway.settings.key_prefix)


async def submit_waited(gateway: Gateway, idempotency_key: str | None,
                        submit: Callable[[str | None], Any]) -> tuple[Any, int | None]:
    """Submit a task whose caller waits for it: named to this process's reply channel, so its
    result is published straight to the waiter.  Returns (its handle, the waiter's ``since``;
    None when the result is to be waited for on its own channel: a repeat of an idempotency
    key returns the first submit's task, which may name another process's channel)."""
    waiter = result_waiter(gateway)
    since = await waiter.listening()
    handle = await run_in_threadpool(submit, waiter.reply_channel if since is not None else None)
    return handle, (since if idempotency_key is None else None)


async def sync_reply(gateway: Gateway, handle: Any, request: Request, timeout_s: float,
                     since: int | None = None) -> Response:
    """Wait for a synchronous endpoint's task (/v1/chat/completions, /v1/embeddings) and answer
    with the upstream's body as-is, or its error: the upstream's 4xx with its status and
    OpenAI error object, a gateway refusal with its status; a client that times out or goes
    away cancels the task (nobody will read the answer).  ``since``: ``submit_waited``'s."""
    meta = await result_waiter(gateway).wait(handle.id, timeout_s, request.is_disconnected, since)
    headers = {"X-Gateway-Task-Id": handle.id, "X-Gateway-Tier": handle.tier}
    if meta is None:
        # the client timed out or went away: nobody will read the answer, so the task
        # must not spend upstream quota later (queued: removed; running: revoked)
        done = await run_in_threadpool(gateway.cancel, handle.id)
        if done.was == FINISHED:
            meta = await run_in_threadpool(gateway.app.backend.get_task_meta, handle.id)
        else:
            raise ApiError(504, "Timeout",
                           f"task {handle.id} did not complete within {timeout_s:g} s; it was "
                           f"cancelled (it was {done.was})", headers, task_id=handle.id,
                           status_url=_status_url(request, handle.id), cancelled=True, was=done.was)
    if meta["status"] != states.SUCCESS:
        error = error_of(meta)
        upstream = error.get("upstream")
        if isinstance(upstream, dict):   # the upstream refused it: its status and error object
            raise ApiError(int(error["status"]), upstream["type"], upstream["message"], headers,
                           param=upstream["param"], code=upstream["code"])
        extra = {k: v for k, v in error.items() if k in ("reason", "retry_after_s")}
        if "retry_after_s" in error:
            headers["Retry-After"] = retry_after_header(error["retry_after_s"])
        raise ApiError(_failure_status(error), error["type"],
                       f"task {handle.id} failed: {error['message']}", headers, task_id=handle.id,
                       **extra)
    result = meta.get("result")
    if not isinstance(result, dict) or not isinstance(result.get("response"), dict):
        raise ApiError(502, "BadResult", f"task {handle.id} returned no upstream response",
                       headers, task_id=handle.id)
    wait_ms = (result.get("timing") or {}).get("queue_wait_ms")
    if wait_ms is not None:
        headers["X-Gateway-Queue-Wait-Ms"] = str(wait_ms)
    return JSONResponse(result["response"], headers=headers)


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="gateway-tasks", version="0.1.0",
                  description="Task queue in front of rate-limited OpenAI-compatible LLM APIs.")
    app.state.gateway = gateway
    encoding()   # tiktoken's encoder loads now, not inside the first request (~0.4 s)
    install_error_handlers(app)
    # the last added runs first: authenticate, then limit the body, then parse it
    app.add_middleware(BodySizeLimit, max_bytes=gateway.settings.max_request_bytes,
                       max_depth=gateway.settings.max_json_depth,
                       upload_bytes=gateway.settings.batch_max_file_bytes + UPLOAD_FRAMING_B)
    settings = gateway.settings
    app.add_middleware(AuthMiddleware, tenants=gateway.tenants, admin_key=settings.admin_key,
                       cache=AuthCache(settings.redis_url, gateway.keys, settings.auth_cache_s,
                                       settings.auth_cache_entries))
    app.include_router(admin_router(gateway))
    app.include_router(crons_router)
    app.include_router(openai_router)
    app.include_router(usage_router)
    app.include_router(batches_router)
    # the Batch API's runner advances the batches (gateway_tasks.batches.runner); several API
    # processes share the work, one batch at a time each
    app.state.batch_runner = BatchRunner(gateway).start() if gateway.settings.batch_dir else None
    install_openapi(app, gateway.settings)

    @app.post("/v1/tasks", status_code=202, name="submit_task")
    def submit_task(body: TaskRequest, request: Request, response: Response,
                    tenant: TenantDep) -> dict[str, Any]:
        handle = gateway.submit(
            tenant.tenant_id, [m.model_dump() for m in body.messages], model=body.model,
            max_tokens=body.max_tokens, deadline_s=body.deadline_s, source="api",
            idempotency_key=body.idempotency_key, extra_body=body.extra_body, depends_on=body.depends_on,
            lane=body.lane, on_behalf_of=body.on_behalf_of,
            on_defer=body.on_defer or request.headers.get(ON_DEFER_HEADER) or "hold")
        status_url = _status_url(request, handle.id)
        response.headers["Location"] = status_url
        out = {"task_id": handle.id, "tier": handle.tier, "lane": handle.lane, "queue": handle.queue,
               "model": handle.model, "prompt_tokens": handle.prompt_tokens,
               "est_tokens": handle.est_tokens, "status_url": status_url}
        if handle.deferral is not None:    # accepted and held: it runs later
            out["deferred"] = handle.deferral.to_json()
        return out

    @app.get("/v1/tasks/{task_id}", name="get_task")
    def get_task(task_id: str, tenant: TenantDep) -> dict[str, Any]:
        return task_view(gateway, tenant, task_id)

    @app.delete("/v1/tasks/{task_id}", name="cancel_task", responses={
        200: {"description": "queued: removed, it never runs (or it was cancelled before)"},
        202: {"description": "running: revoked; a call already in flight finishes and its result "
                             "is discarded", "content": {"application/json": {"schema": {"type": "object"}}}},
        409: {"description": "the task already finished (TaskFinished): nothing to cancel"}})
    def cancel_task(task_id: str, tenant: TenantDep) -> JSONResponse:
        try:
            done = gateway.cancel(task_id, tenant.tenant_id)
        except UnknownTask:
            raise ApiError(404, "NotFound", f"no task {task_id!r} for this tenant") from None
        if done.was == "already_cancelled":
            return JSONResponse({"task_id": task_id, "cancelled": True, "was": done.was})
        if done.was == FINISHED:
            raise ApiError(409, "TaskFinished", f"task {task_id} already finished ({done.status}); "
                           f"nothing to cancel", task_id=task_id, task_status=done.status)
        return JSONResponse({"task_id": task_id, "cancelled": True, "was": done.was},
                            status_code=202 if done.was == "running" else 200)

    @app.post("/v1/chat/completions", name="chat_completions", responses={200: {
        "description": "the upstream's chat.completion; with stream=true, server-sent events of "
                       "chat.completion.chunk objects ending with 'data: [DONE]'",
        "content": {"application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": {   # one server-sent event
                        "type": "object", "properties": {"data": {"type": "string"}},
                        "required": ["data"]}}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               tenant: TenantDep) -> Response:
        if body.stream_options is not None and not body.stream:
            raise InvalidRequest("stream_options is only allowed with stream=true")
        idempotency_key = body.idempotency_key or request.headers.get("Idempotency-Key")
        extras = body.upstream_extras()
        if body.max_completion_tokens is not None:   # max_tokens by OpenAI's newer name (submit checks both)
            extras["max_completion_tokens"] = body.max_completion_tokens
        messages = [m.model_dump() for m in body.messages]

        def submit(reply_channel: str | None = None) -> Any:
            return gateway.submit(
                tenant.tenant_id, messages, model=body.model, max_tokens=body.max_tokens,
                deadline_s=body.deadline_s, source="api-sync", idempotency_key=idempotency_key,
                extra_body=extras or None, stream=body.stream, reply_channel=reply_channel,
                on_defer="refuse")   # its caller waits for the answer: a deferral is a 429 here
        timeout_s = sync_timeout_s(body.deadline_s, request.headers)
        if body.stream:      # server-sent events through the queue (gateway_tasks.rest.streaming)
            return streaming_response(gateway, await run_in_threadpool(submit), body.include_usage(), timeout_s)
        handle, since = await submit_waited(gateway, idempotency_key, submit)
        return await sync_reply(gateway, handle, request, timeout_s, since)

    @app.post("/v1/embeddings", name="embeddings", responses={200: {
        "description": "the upstream's list of embedding objects with its usage",
        "content": {"application/json": {"schema": {"type": "object"}}}}})
    async def embeddings(body: EmbeddingRequest, request: Request, tenant: TenantDep) -> Response:
        """Through the same queue, fairness and TPM accounting as chat: the input's tokens are
        its estimate (the same tokenizer), nothing reserved for a completion."""
        idempotency_key = body.idempotency_key or request.headers.get("Idempotency-Key")

        def submit(reply_channel: str | None = None) -> Any:
            return gateway.submit(tenant.tenant_id, body.input, model=body.model, deadline_s=body.deadline_s,
                                  source="api-sync", idempotency_key=idempotency_key,
                                  extra_body=body.upstream_extras() or None, endpoint=EMBEDDINGS,
                                  reply_channel=reply_channel)
        handle, since = await submit_waited(gateway, idempotency_key, submit)
        return await sync_reply(gateway, handle, request, sync_timeout_s(body.deadline_s, request.headers), since)

    @app.get("/v1/status", name="status")
    def status(tenant: TenantDep) -> dict[str, Any]:
        return deployment_status(gateway.r, gateway.settings, tenant_id=tenant.tenant_id)

    @app.get("/healthz", name="healthz")
    def healthz() -> JSONResponse:
        try:
            gateway.r.ping()
        except redis.RedisError as exc:
            return JSONResponse(error_body("ServiceUnavailable",
                                           f"Redis ping failed ({type(exc).__name__})"),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", name="metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics(_admin: AdminDep) -> Response:
        return Response(render(gateway, gateway.settings), media_type=CONTENT_TYPE)

    return app
