"""Tenant authentication: ``Authorization: Bearer <tenant api key>``.

It runs first on every /v1 route, as an ASGI middleware, before anything reads
or validates the request body: a caller without a valid key always gets 401
and learns nothing else about its request (not whether the body was valid, nor
too large, nor whether a task id exists).  Routes read the authenticated tenant
with the ``TenantDep`` dependency.
"""

from __future__ import annotations

from typing import Annotated

import redis
from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway_tasks.core.errors import ApiError, UnknownTenant
from gateway_tasks.core.tenants import Tenant, TenantRegistry
from gateway_tasks.rest.errors import api_error_response, redis_error_response

PROTECTED_PREFIX = "/v1/"

# only documents the scheme in the OpenAPI schema: AuthMiddleware does the checking
_bearer = HTTPBearer(auto_error=False, description="the tenant's API key")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "Unauthorized", message, {"WWW-Authenticate": "Bearer"})


def authenticate(tenants: TenantRegistry, authorization: str | None) -> Tenant:
    """The tenant of an ``Authorization`` header value, or ApiError 401."""
    scheme, api_key = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not api_key:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <api key>'")
    try:
        return tenants.authenticate(api_key)
    except UnknownTenant:
        raise _unauthorized("invalid API key") from None


def _route_path(scope: Scope) -> str:
    """The request path without the app's root_path (what the router matches)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class AuthMiddleware:
    """Authenticates every request under /v1/ before the app sees it; the tenant
    is stored in the request state (``request.state.tenant``)."""

    def __init__(self, app: ASGIApp, tenants: TenantRegistry):
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _route_path(scope).startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            tenant = await run_in_threadpool(authenticate, self.tenants,
                                             Headers(scope=scope).get("authorization"))
        except ApiError as exc:
            await api_error_response(exc)(scope, receive, send)
            return
        except redis.RedisError as exc:
            await redis_error_response(exc)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def _tenant_of(request: Request,
               _creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Tenant:
    """The tenant AuthMiddleware authenticated; a route outside /v1/ has none: 401."""
    tenant = getattr(request.state, "tenant", None)
    if not isinstance(tenant, Tenant):
        raise _unauthorized("this route is not behind tenant authentication")
    return tenant


TenantDep = Annotated[Tenant, Depends(_tenant_of)]
