"""HTTP side of the error hierarchy: the JSON error body, the status of each
GatewayError, and the app's exception handlers.

Every error answers ``{"error": {"type", "message", ...}}``.  Redis down or full is a 503
with Retry-After whose message is the gateway's words ("the gateway's Redis is
unreachable; retry later"): the client's error -- an address, a command, a key -- goes to
the server's log, never into the body.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from gateway_tasks.core.errors import ApiError, ConfigError, Deferred, GatewayError, InvalidRequest, \
    PromptTooLarge, RedisUnavailable, Rejected, UnknownTask, UnknownTenant
from gateway_tasks.core.redis_failures import CLIENT_ERRORS, as_unavailable
from gateway_tasks.tenants.registry import Tenant

log = logging.getLogger(__name__)

RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60
_HTTP_ERROR_TYPES = {400: "ValidationError", 404: "NotFound", 405: "MethodNotAllowed",
                     415: "UnsupportedMediaType"}


def status_for(exc: GatewayError) -> int:
    """HTTP status of a GatewayError raised while handling a request."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, (UnknownTenant, UnknownTask)):
        return 404
    if isinstance(exc, PromptTooLarge):
        return 413
    if isinstance(exc, InvalidRequest):
        return 400
    if isinstance(exc, Rejected):      # QueueFull, Evicted, QuotaExceeded
        return 429
    return 503


def error_body(type_: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message, **extra}}


def api_error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.type, exc.message, **exc.extra), status_code=exc.status,
                        headers=exc.headers)


def unavailable_message(exc: RedisUnavailable) -> str:
    """What a client is told of ``exc``; its detail is logged here instead."""
    log.warning("503: %s", exc)
    return exc.public_message


def redis_error_response(exc: redis.RedisError | OperationalError) -> JSONResponse:
    """503 for an error of the Redis client (or kombu's) that reached the app."""
    message = unavailable_message(as_unavailable(exc))
    return JSONResponse(error_body("ServiceUnavailable", message),
                        status_code=503, headers={"Retry-After": str(RETRY_AFTER_MIN_S)})


def retry_after_header(seconds: float) -> str:
    """The Retry-After header (whole seconds, at least 1) of a retry_after_s."""
    return str(max(RETRY_AFTER_MIN_S, math.ceil(seconds)))


def _retry_after_s(request: Request, exc: GatewayError) -> int:
    """Retry-After of a 429: the error's own retry_after_s (a quota's reset), else the
    tenant tier's max wait, clamped to [1, 60] s."""
    own = getattr(exc, "retry_after_s", None)
    if own is not None:
        return int(retry_after_header(own))
    tenant: Tenant | None = getattr(request.state, "tenant", None)
    seconds = RETRY_AFTER_MIN_S
    if tenant is not None:
        try:
            seconds = math.ceil(request.app.state.gateway.settings.tier(tenant.tier).max_wait_ms / 1000)
        except ConfigError:
            pass
    return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, seconds))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        if isinstance(exc, ApiError):
            return api_error_response(exc)
        if isinstance(exc, Deferred):
            # overload: the tier's new work is deferred; the body says until when and why
            retry_s = max(RETRY_AFTER_MIN_S, math.ceil(exc.retry_after_s or 0))
            return JSONResponse(error_body("Deferred", str(exc), retry_after_s=exc.retry_after_s,
                                           reason=exc.reason, level=exc.level),
                                status_code=429, headers={"Retry-After": str(retry_s)})
        status = status_for(exc)
        extra: dict[str, Any] = {}
        headers = None
        if status == 429:
            retry_s = _retry_after_s(request, exc)
            headers = {"Retry-After": str(retry_s)}
            extra["retry_after_s"] = retry_s
        message = str(exc)
        if isinstance(exc, RedisUnavailable):   # 503: Redis down or full, nothing enqueued
            headers = {"Retry-After": str(RETRY_AFTER_MIN_S)}
            message = unavailable_message(exc)
        details = getattr(exc, "details", None)
        if callable(details):
            extra.update(details())
        return JSONResponse(error_body(type(exc).__name__, message, **extra), status_code=status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        """Schema errors and malformed JSON: 400, like every other invalid request."""
        details = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")),
                    "type": str(e.get("type", ""))} for e in exc.errors()]
        message = "; ".join(f"{'.'.join(d['loc'])}: {d['msg']}" for d in details) or "invalid request"
        return JSONResponse(error_body("ValidationError", message, details=details), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (unknown route 404, wrong method 405, an unparsable body
        400) in the same error body as every other answer."""
        type_ = _HTTP_ERROR_TYPES.get(exc.status_code, "HTTPError")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": allowed_methods(request)}
        return JSONResponse(error_body(type_, str(exc.detail)), status_code=exc.status_code,
                            headers=headers)

    for client_error in CLIENT_ERRORS:      # redis-py's and kombu's: 503
        app.add_exception_handler(client_error, _client_error)


def allowed_methods(request: Request) -> str:
    """The Allow header of a 405: the methods of every route on the request's path (Starlette
    names only the first route's)."""
    methods: set[str] = set()
    for route in _leaf_routes(request.app.router.routes):
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def _leaf_routes(routes: Any) -> Any:
    """The app's routes, an included router's (FastAPI keeps it whole, as ``original_router``,
    its routes' paths prefixed already) in its place."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _leaf_routes(included.routes)
        else:
            yield route


async def _client_error(request: Request, exc: Exception) -> JSONResponse:
    return redis_error_response(exc)   # type: ignore[arg-type]
