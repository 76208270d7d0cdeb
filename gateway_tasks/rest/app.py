"""The REST trigger: submit tasks over HTTP, read their results, and an
OpenAI-compatible synchronous endpoint so the openai SDK can point at the gateway.

    POST /v1/tasks              202 {task_id, tier, queue, model, prompt_tokens, est_tokens, status_url}
    GET  /v1/tasks/{task_id}    {task_id, status, result? | error?}  (own tasks only)
    POST /v1/chat/completions   submit, wait, return the upstream body as-is
    GET  /v1/status             the load level, its reason and history, pools' circuits
    GET  /healthz               Redis ping
    GET  /metrics               Prometheus text (gateway_tasks.metrics.exporter)

Every /v1 request authenticates first with ``Authorization: Bearer <tenant api
key>`` (gateway_tasks.rest.auth), then its body is limited to
settings.max_request_bytes (gateway_tasks.rest.limits), then it is parsed
(gateway_tasks.rest.models).  Errors are JSON ``{"error": {"type", "message"}}``
(gateway_tasks.rest.errors).  ``gateway api`` serves it (gateway_tasks.rest.cli).
"""

from __future__ import annotations

from typing import Any

import redis
from celery import states
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from gateway_tasks.core.errors import ApiError, InvalidRequest
from gateway_tasks.core.status import deployment_status
from gateway_tasks.metrics.exporter import CONTENT_TYPE, render
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.auth import AuthMiddleware, TenantDep
from gateway_tasks.rest.errors import error_body, install_error_handlers
from gateway_tasks.rest.limits import BodySizeLimit
from gateway_tasks.rest.models import ChatCompletionRequest, TaskRequest
from gateway_tasks.rest.results import error_of, task_view, wait_for_meta

DEFAULT_SYNC_TIMEOUT_S = 60.0


def _status_url(request: Request, task_id: str) -> str:
    """The task's status path (relative: correct behind any proxy; includes root_path)."""
    return request.url_for("get_task", task_id=task_id).path


def _failure_status(error: dict[str, str]) -> int:
    return 504 if error["type"] == "DeadlineExceeded" else 502


def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="gateway-tasks", version="0.1.0",
                  description="Task queue in front of rate-limited OpenAI-compatible LLM APIs.")
    app.state.gateway = gateway
    install_error_handlers(app)
    # the last added runs first: authenticate, then limit the body, then parse it
    app.add_middleware(BodySizeLimit, max_bytes=gateway.settings.max_request_bytes)
    app.add_middleware(AuthMiddleware, tenants=gateway.tenants)

    @app.post("/v1/tasks", status_code=202, name="submit_task")
    def submit_task(body: TaskRequest, request: Request, response: Response,
                    tenant: TenantDep) -> dict[str, Any]:
        handle = gateway.submit(
            tenant.tenant_id, [m.model_dump() for m in body.messages], model=body.model,
            max_tokens=body.max_tokens, deadline_s=body.deadline_s, source="api",
            idempotency_key=body.idempotency_key, extra_body=body.extra_body)
        status_url = _status_url(request, handle.id)
        response.headers["Location"] = status_url
        return {"task_id": handle.id, "tier": handle.tier, "queue": handle.queue,
                "model": handle.model, "prompt_tokens": handle.prompt_tokens,
                "est_tokens": handle.est_tokens, "status_url": status_url}

    @app.get("/v1/tasks/{task_id}", name="get_task")
    def get_task(task_id: str, tenant: TenantDep) -> dict[str, Any]:
        return task_view(gateway, tenant, task_id)

    @app.post("/v1/chat/completions", name="chat_completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               tenant: TenantDep) -> JSONResponse:
        if body.stream:
            raise InvalidRequest("stream=true is not supported: the gateway queues the request "
                                 "and returns the whole completion")
        idempotency_key = body.idempotency_key or request.headers.get("Idempotency-Key")
        handle = await run_in_threadpool(
            gateway.submit, tenant.tenant_id, [m.model_dump() for m in body.messages],
            model=body.model, max_tokens=body.max_tokens or body.max_completion_tokens,
            deadline_s=body.deadline_s, source="api-sync", idempotency_key=idempotency_key,
            extra_body=body.upstream_extras() or None)
        timeout_s = body.deadline_s or DEFAULT_SYNC_TIMEOUT_S
        status_url = _status_url(request, handle.id)
        meta = await wait_for_meta(gateway, handle.id, timeout_s)
        headers = {"X-Gateway-Task-Id": handle.id, "X-Gateway-Tier": handle.tier}
        if meta is None:
            raise ApiError(504, "Timeout",
                           f"task {handle.id} did not complete within {timeout_s:g} s; it is still "
                           f"queued or running: poll {status_url}",
                           headers, task_id=handle.id, status_url=status_url)
        if meta["status"] != states.SUCCESS:
            error = error_of(meta)
            raise ApiError(_failure_status(error), error["type"],
                           f"task {handle.id} failed: {error['message']}", headers, task_id=handle.id)
        result = meta.get("result")
        if not isinstance(result, dict) or not isinstance(result.get("response"), dict):
            raise ApiError(502, "BadResult", f"task {handle.id} returned no upstream response",
                           headers, task_id=handle.id)
        wait_ms = (result.get("timing") or {}).get("queue_wait_ms")
        if wait_ms is not None:
            headers["X-Gateway-Queue-Wait-Ms"] = str(wait_ms)
        return JSONResponse(result["response"], headers=headers)

    @app.get("/v1/status", name="status")
    def status(tenant: TenantDep) -> dict[str, Any]:
        return deployment_status(gateway.r, gateway.settings)

    @app.get("/healthz", name="healthz")
    def healthz() -> JSONResponse:
        try:
            gateway.r.ping()
        except redis.RedisError as exc:
            return JSONResponse(error_body("ServiceUnavailable", f"Redis ping failed: {exc}"),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", name="metrics")
    def metrics() -> Response:
        return Response(render(gateway, gateway.settings), media_type=CONTENT_TYPE)

    return app
