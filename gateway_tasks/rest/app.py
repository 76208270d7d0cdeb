"""The REST trigger: submit tasks over HTTP, read their results, and an
OpenAI-compatible synchronous endpoint so the openai SDK can point at the gateway.

    POST /v1/tasks              202 {task_id, tier, queue, model, prompt_tokens, est_tokens, status_url}
    GET  /v1/tasks/{task_id}    {task_id, status, result? | error?}  (own tasks only)
    POST /v1/chat/completions   submit, wait, return the upstream body as-is
    GET  /healthz               Redis ping
    GET  /metrics               Prometheus text (gateway_tasks.metrics.exporter)

Every request authenticates with ``Authorization: Bearer <tenant api key>``
(except /healthz and /metrics).  Errors are JSON ``{"error": {"type", "message"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Annotated, Any, Literal

import redis
from celery import states
from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway_tasks.core.errors import ConfigError, GatewayError, InvalidRequest, PromptTooLarge, QueueFull, \
    QuotaExceeded, UnknownTenant
from gateway_tasks.metrics.exporter import CONTENT_TYPE, render
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.core.settings import Settings, get_settings
from gateway_tasks.core.tenants import Tenant

DEFAULT_SYNC_TIMEOUT_S = 60.0
POLL_FIRST_S = 0.02
POLL_MAX_S = 0.5
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60
# fields of an OpenAI chat request the gateway handles itself (never forwarded in extra_body)
_OWN_CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "stream",
                    "deadline_s", "idempotency_key"}


class ApiError(GatewayError):
    """An HTTP-level refusal (auth, not found, timeout) with its status code."""

    def __init__(self, status: int, type_: str, message: str,
                 headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.headers = headers or {}
        self.extra = extra


# -- request models ------------------------------------------------------------
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str = Field(description="the message text")


def _prompt_to_messages(value: Any) -> Any:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


class TaskRequest(BaseModel):
    """POST /v1/tasks."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(
        min_length=1, description="chat messages; a plain string is taken as one user message")
    model: str | None = Field(default=None, min_length=1,
                              description="a model served by one of the pools (default: first pool's)")
    max_tokens: int | None = Field(default=None, gt=0, strict=True,
                                   description="completion token limit (default: settings)")
    deadline_s: float | None = Field(default=None, gt=0,
                                     description="drop the task if it waits longer in the queue")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256,
                                        description="same key, same tenant -> same task id, "
                                                    "enqueued once")
    extra_body: dict[str, Any] | None = Field(
        default=None, description="other upstream parameters (temperature, top_p, ...)")

    _messages = field_validator("messages", mode="before")(_prompt_to_messages)


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions: an OpenAI chat request; unknown fields go upstream."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, gt=0, strict=True)
    max_completion_tokens: int | None = Field(default=None, gt=0, strict=True)
    stream: bool = False
    deadline_s: float | None = Field(default=None, gt=0,
                                     description="gateway extension: queue deadline and wait timeout")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)

    def upstream_extras(self) -> dict[str, Any]:
        return {k: v for k, v in (self.model_extra or {}).items() if k not in _OWN_CHAT_FIELDS}


# -- error mapping -------------------------------------------------------------
def status_for(exc: GatewayError) -> int:
    """HTTP status of a GatewayError raised while handling a request."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, UnknownTenant):
        return 404
    if isinstance(exc, PromptTooLarge):
        return 413
    if isinstance(exc, InvalidRequest):
        return 400
    if isinstance(exc, (QueueFull, QuotaExceeded)):
        return 429
    return 503


def error_body(type_: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message, **extra}}


def _retry_after_s(request: Request) -> int:
    """Retry-After for a full queue: the tenant tier's max wait, clamped to [1, 60] s."""
    tenant: Tenant | None = getattr(request.state, "tenant", None)
    gateway: Gateway = request.app.state.gateway
    seconds = RETRY_AFTER_MIN_S
    if tenant is not None:
        try:
            seconds = math.ceil(gateway.settings.tier(tenant.tier).max_wait_ms / 1000)
        except ConfigError:
            pass
    return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, seconds))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        if isinstance(exc, ApiError):
            return JSONResponse(error_body(exc.type, exc.message, **exc.extra),
                                status_code=exc.status, headers=exc.headers)
        status = status_for(exc)
        headers = {"Retry-After": str(_retry_after_s(request))} if status == 429 else None
        return JSONResponse(error_body(type(exc).__name__, str(exc)), status_code=status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")),
                    "type": str(e.get("type", ""))} for e in exc.errors()]
        message = "; ".join(f"{'.'.join(d['loc'])}: {d['msg']}" for d in details) or "invalid request"
        return JSONResponse(error_body("ValidationError", message, details=details), status_code=422)

    @app.exception_handler(redis.RedisError)
    async def redis_error(request: Request, exc: redis.RedisError) -> JSONResponse:
        return JSONResponse(error_body("ServiceUnavailable", f"Redis is unavailable: {exc}"),
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_MIN_S)})


# -- helpers -------------------------------------------------------------------
_bearer = HTTPBearer(auto_error=False, description="the tenant's API key")


def _tenant_of(request: Request,
               creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Tenant:
    challenge = {"WWW-Authenticate": "Bearer"}
    if creds is None or not creds.credentials:
        raise ApiError(401, "Unauthorized", "missing API key: send 'Authorization: Bearer <api key>'",
                       challenge)
    gateway: Gateway = request.app.state.gateway
    try:
        tenant = gateway.tenants.authenticate(creds.credentials)
    except UnknownTenant:
        raise ApiError(401, "Unauthorized", "invalid API key", challenge) from None
    request.state.tenant = tenant
    return tenant


TenantDep = Annotated[Tenant, Depends(_tenant_of)]


def _owner_of(meta: dict[str, Any]) -> str | None:
    """The tenant id recorded with a task's result (result body, else the task's args)."""
    result = meta.get("result")
    if isinstance(result, dict) and isinstance(result.get("tenant_id"), str):
        return result["tenant_id"]
    args = meta.get("args")
    if isinstance(args, (list, tuple)) and args and isinstance(args[0], dict):
        owner = args[0].get("tenant_id")
        return owner if isinstance(owner, str) else None
    kwargs = meta.get("kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("req"), dict):
        owner = kwargs["req"].get("tenant_id")
        return owner if isinstance(owner, str) else None
    return None


def _error_of(meta: dict[str, Any]) -> dict[str, str]:
    exc = meta.get("result")
    if isinstance(exc, BaseException):
        return {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, dict) and "exc_type" in exc:
        message = exc.get("exc_message")
        if isinstance(message, (list, tuple)):
            message = " ".join(str(m) for m in message)
        return {"type": str(exc["exc_type"]), "message": str(message or "")}
    return {"type": "TaskFailed", "message": str(exc) if exc is not None else ""}


def task_view(gateway: Gateway, tenant: Tenant, task_id: str) -> dict[str, Any]:
    """The public view of a task, or ApiError 404 if it is another tenant's.

    A task with no stored state yet is PENDING (queued, or unknown: Celery
    cannot tell them apart); its view reveals nothing, so it needs no owner check.
    """
    meta = gateway.app.backend.get_task_meta(task_id)
    status = str(meta.get("status") or states.PENDING)
    view: dict[str, Any] = {"task_id": task_id, "status": status}
    if status == states.PENDING:
        return view
    if _owner_of(meta) != tenant.tenant_id:
        raise ApiError(404, "NotFound", f"no task {task_id!r} for this tenant")
    if status == states.SUCCESS:
        view["result"] = meta.get("result")
    elif status in states.EXCEPTION_STATES:
        view["error"] = _error_of(meta)
    return view


async def wait_for_meta(gateway: Gateway, task_id: str, timeout_s: float) -> dict[str, Any] | None:
    """Poll the result backend until the task is ready; None on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = POLL_FIRST_S
    while True:
        meta = await run_in_threadpool(gateway.app.backend.get_task_meta, task_id)
        if meta.get("status") in states.READY_STATES:
            return meta
        remaining = deadline - loop.time()
        if remaining <= 0:
            return None
        await asyncio.sleep(min(delay, remaining))
        delay = min(delay * 1.5, POLL_MAX_S)


def _status_url(request: Request, task_id: str) -> str:
    """The task's status path (relative: correct behind any proxy; includes root_path)."""
    return request.url_for("get_task", task_id=task_id).path


def _failure_status(error: dict[str, str]) -> int:
    return 504 if error["type"] == "DeadlineExceeded" else 502


# -- the app -------------------------------------------------------------------
def create_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="gateway-tasks", version="0.1.0",
                  description="Task queue in front of rate-limited OpenAI-compatible LLM APIs.")
    app.state.gateway = gateway
    _install_error_handlers(app)

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
            error = _error_of(meta)
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


# -- serving -------------------------------------------------------------------
def serve(settings: Settings, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the API with uvicorn (one process; scale out with replicas)."""
    import uvicorn

    if not settings.redis_url:
        raise ConfigError("REDIS_URL is not set; the API needs the deployment's Redis, "
                          "e.g. REDIS_URL=redis://127.0.0.1:6379/0")
    uvicorn.run(create_app(Gateway(settings)), host=host, port=port)


def _run(args: argparse.Namespace) -> int:
    serve(get_settings(), args.host, args.port)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``api`` command to the ``gateway`` CLI."""
    parser = subparsers.add_parser(
        "api", help="serve the REST API (submit tasks, read results, OpenAI-compatible endpoint)",
        description="Serve the gateway's REST API with uvicorn. Reads REDIS_URL and "
                    "GATEWAY_CONFIG like the workers.")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s)")
    parser.set_defaults(func=_run)
