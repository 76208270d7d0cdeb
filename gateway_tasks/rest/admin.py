"""The admin REST routes (behind the admin credential, see gateway_tasks.rest.auth):

    POST   /v1/admin/tenants               201 register a tenant (or change its tier / rotate its
                                               key); the API key is in this answer only
    GET    /v1/admin/tenants               the tenants (never a key or a key hash)
    GET    /v1/admin/tenants/{tenant_id}   one tenant, 404 if unknown
    DELETE /v1/admin/tenants/{tenant_id}   delete it: its key stops working at once, its crons
                                           go, its unfinished tasks are cancelled
    GET    /v1/admin/settings              the deployment's settings without any secret
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from gateway_tasks.core.errors import ApiError, ConfigError, InvalidRequest, UnknownTenant
from gateway_tasks.tenants.registry import MAX_API_KEY_CHARS, Tenant
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.auth import AdminDep

from beat.api import delete_tenant as delete_tenant_and_owned


class TenantRegistration(BaseModel):
    """POST /v1/admin/tenants."""

    model_config = ConfigDict(extra="forbid")

    tenant_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    tier: str = Field(min_length=1, max_length=64, description="tier name or alias (vip, normal, ...)")
    weight: float = Field(default=1.0, gt=0, le=1000, description="share inside its tier")
    api_key: str | None = Field(default=None, min_length=8, max_length=MAX_API_KEY_CHARS,
                                description="use this key instead of generating one")


def tenant_view(tenant: Tenant) -> dict[str, Any]:
    return {"tenant_id": tenant.tenant_id, "tier": tenant.tier, "weight": tenant.weight,
            "created_ms": tenant.created_ms}


def _not_found(tenant_id: str) -> ApiError:
    return ApiError(404, "NotFound", f"no tenant {tenant_id!r}")


def admin_router(gateway: Gateway) -> APIRouter:
    router = APIRouter(prefix="/v1/admin", tags=["admin"])
    tenants = gateway.tenants

    @router.post("/tenants", status_code=201, name="admin_register_tenant")
    def register_tenant(body: TenantRegistration, _admin: AdminDep) -> dict[str, Any]:
        try:
            tenant, api_key = tenants.register(body.tenant_id, body.tier, body.api_key, body.weight)
        except ConfigError as exc:   # an unknown tier: the request's fault, not the server's
            raise InvalidRequest(str(exc)) from None
        return {**tenant_view(tenant), "api_key": api_key}

    @router.get("/tenants", name="admin_list_tenants")
    def list_tenants(_admin: AdminDep) -> dict[str, Any]:
        return {"tenants": [tenant_view(t) for t in tenants.list()]}

    @router.get("/tenants/{tenant_id}", name="admin_get_tenant")
    def get_tenant(tenant_id: str, _admin: AdminDep) -> dict[str, Any]:
        try:
            return tenant_view(tenants.get(tenant_id))
        except UnknownTenant:
            raise _not_found(tenant_id) from None

    @router.delete("/tenants/{tenant_id}", name="admin_delete_tenant")
    async def delete_tenant(tenant_id: str, _admin: AdminDep) -> dict[str, Any]:
        try:
            return await run_in_threadpool(delete_tenant_and_owned, gateway.settings, gateway.r, tenant_id,
                                           gateway=gateway)
        except UnknownTenant:
            raise _not_found(tenant_id) from None

    @router.get("/settings", name="admin_settings")
    def settings(_admin: AdminDep) -> dict[str, Any]:
        return dataclasses.asdict(gateway.settings.public())

    return router
