"""``GET /v1/usage``: the calling tenant's own usage, per hour and per day
(``gateway_tasks.usage.counters``): requests served, estimated and actual tokens, failures,
expiries, upstream 429s absorbed, degradations, deferrals and refusals."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query, Request

from gateway_tasks.rest.auth import TenantDep
from gateway_tasks.usage.counters import usage_report

router = APIRouter(tags=["usage"])


@router.get("/v1/usage", name="usage")
def get_usage(request: Request, tenant: TenantDep,
              hours: int = Query(24, ge=1, le=24 * 3660, description="the last N clock hours"),
              days: int = Query(7, ge=1, le=3660, description="the last N UTC days")) -> dict[str, Any]:
    gw = request.app.state.gateway
    return usage_report(gw.r, gw.keys, tenant.tenant_id, int(time.time() * 1000), hours, days,
                        gw.settings.usage_retention_days)
