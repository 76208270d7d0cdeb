"""Authentication of every REST request, before anything reads its body.

Deny by default: an ASGI middleware sorts each request by its path --

* ``PUBLIC_PATHS`` (``/healthz``, the OpenAPI schema and its docs pages): open;
* ``/v1/admin/...`` and ``/metrics``: the admin credential,
  ``Authorization: Bearer <settings.admin_key>`` (``GATEWAY_ADMIN_KEY``; with none
  configured the admin API is off and answers 401);
* everything else, every route added later included: a tenant's API key,
  ``Authorization: Bearer <tenant api key>``.

A caller without the right credential always gets 401 and learns nothing else
about its request (not whether the body was valid, nor too large, nor whether a
task id exists, nor whether the route exists).  Keys are compared by digest in
constant time (gateway_tasks.tenants.registry; the admin key through SHA-256 of both
sides); a key authenticated within ``settings.auth_cache_s`` is taken from the process's
auth cache, which drops a tenant the moment its key or registration changes
(gateway_tasks.tenants.auth_cache).  Routes read the caller with the ``TenantDep`` / ``AdminDep`` dependencies.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

import redis
from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway_tasks.core.errors import ApiError, UnknownTenant
from gateway_tasks.tenants.auth_cache import AuthCache
from gateway_tasks.tenants.registry import Tenant, TenantRegistry
from gateway_tasks.rest.errors import api_error_response, redis_error_response

PUBLIC = "public"
ADMIN = "admin"
TENANT = "tenant"
PUBLIC_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
ADMIN_PREFIX = "/v1/admin/"
ADMIN_PATHS = frozenset({"/metrics", "/v1/admin"})

# only document the schemes in the OpenAPI schema: AuthMiddleware does the checking
_bearer = HTTPBearer(auto_error=False, scheme_name="TenantKey", description="the tenant's API key")
_admin_bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey",
                           description="the admin credential (settings.admin_key, GATEWAY_ADMIN_KEY)")


def access_of(path: str) -> str:
    """Which credential a request path needs: PUBLIC, ADMIN or TENANT (the default)."""
    if path in PUBLIC_PATHS:
        return PUBLIC
    if path in ADMIN_PATHS or path.startswith(ADMIN_PREFIX):
        return ADMIN
    return TENANT


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "Unauthorized", message, {"WWW-Authenticate": "Bearer"})


def _bearer_token(authorization: str | None) -> str:
    scheme, token = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("missing API key: send 'Authorization: Bearer <api key>'")
    return token


def authenticate(tenants: TenantRegistry, authorization: str | None) -> Tenant:
    """The tenant of an ``Authorization`` header value, or ApiError 401."""
    api_key = _bearer_token(authorization)
    try:
        return tenants.authenticate(api_key)
    except UnknownTenant:
        raise _unauthorized("invalid API key") from None


def authenticate_admin(admin_key: str, authorization: str | None) -> None:
    """Check the admin credential of an ``Authorization`` header value, or ApiError 401."""
    if not admin_key:
        raise _unauthorized("the admin API is off: set the admin credential (GATEWAY_ADMIN_KEY)")
    given = _bearer_token(authorization)
    if not hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "replace")).digest(),
                               hashlib.sha256(admin_key.encode("utf-8")).digest()):
        raise _unauthorized("invalid admin credential")


def _route_path(scope: Scope) -> str:
    """The request path without the app's root_path (what the router matches)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class AuthMiddleware:
    """Authenticates every request that is not public before the app sees it; the
    tenant is stored in the request state (``request.state.tenant``), an admin
    caller as ``request.state.admin = True``."""

    def __init__(self, app: ASGIApp, tenants: TenantRegistry, admin_key: str = "",
                 cache: AuthCache | None = None):
        self.app = app
        self.tenants = tenants
        self._admin_key = admin_key
        self.cache = cache

    def __repr__(self) -> str:  # never the admin key
        return f"AuthMiddleware(admin={'on' if self._admin_key else 'off'})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        access = access_of(_route_path(scope)) if scope["type"] == "http" else PUBLIC
        if access == PUBLIC:
            await self.app(scope, receive, send)
            return
        authorization = Headers(scope=scope).get("authorization")
        state = scope.setdefault("state", {})
        try:
            if access == ADMIN:
                authenticate_admin(self._admin_key, authorization)
                state["admin"] = True
            else:
                state["tenant"] = await self._tenant(authorization)
        except ApiError as exc:
            await api_error_response(exc)(scope, receive, send)
            return
        except redis.RedisError as exc:
            await redis_error_response(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _tenant(self, authorization: str | None) -> Tenant:
        """The caller's tenant: from the auth cache when it kept the key, else through Redis
        (in a thread), kept if no change of any tenant was announced meanwhile."""
        cache = self.cache
        if cache is None or not cache.enabled:
            return await run_in_threadpool(authenticate, self.tenants, authorization)
        api_key = _bearer_token(authorization)
        found = cache.cached(api_key)
        if found is not None:
            return found
        await cache.listening()
        token = cache.token()
        tenant = await run_in_threadpool(authenticate, self.tenants, authorization)
        cache.keep(api_key, tenant, token)
        return tenant


def _tenant_of(request: Request,
               _creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Tenant:
    """The tenant AuthMiddleware authenticated; a route outside tenant auth has none: 401."""
    tenant = getattr(request.state, "tenant", None)
    if not isinstance(tenant, Tenant):
        raise _unauthorized("this route is not behind tenant authentication")
    return tenant


def _admin_of(request: Request,
              _creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_bearer)]) -> bool:
    """True when AuthMiddleware checked the admin credential; else 401."""
    if getattr(request.state, "admin", False) is not True:
        raise _unauthorized("this route is not behind admin authentication")
    return True


TenantDep = Annotated[Tenant, Depends(_tenant_of)]
AdminDep = Annotated[bool, Depends(_admin_of)]
