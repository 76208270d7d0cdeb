"""Tenant authentication: ``Authorization: Bearer <tenant api key>``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway_tasks.core.errors import ApiError, UnknownTenant
from gateway_tasks.core.tenants import Tenant
from gateway_tasks.producer.gateway import Gateway

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
