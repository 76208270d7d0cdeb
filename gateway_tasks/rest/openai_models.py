"""``GET /v1/models`` and ``GET /v1/models/{model}``: what the calling tenant may use, in
OpenAI's format (``client.models.list()`` / ``.retrieve()``).

A model is listed when a pool serves it (``Pool.models``), for every tenant: any tier may
use any pool.  The fallback models the load level substitutes (``Overload.fallback_models``,
a pool's ``fallback_model``) are among them: a fallback no pool serves is never substituted
(``overload.actions.degrade``), and a model no pool serves cannot be asked for.
``owned_by`` names the pools that serve it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway_tasks.core.errors import ApiError
from gateway_tasks.core.settings import Settings
from gateway_tasks.rest.auth import TenantDep

router = APIRouter(tags=["models"])
CREATED = 0   # the listing is the configuration's, not a model's release date


def served_models(settings: Settings) -> dict[str, list[str]]:
    """model -> the pools serving it, in configuration order (pure)."""
    served: dict[str, list[str]] = {}
    for pool in settings.pools:
        for model in pool.models:
            served.setdefault(model, []).append(pool.name)
    return served


def _model(model: str, pools: list[str]) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": CREATED, "owned_by": "gateway-tasks:" + ",".join(pools)}


@router.get("/v1/models", name="list_models")
def list_models(request: Request, tenant: TenantDep) -> dict[str, Any]:
    settings = request.app.state.gateway.settings
    return {"object": "list", "data": [_model(m, p) for m, p in served_models(settings).items()]}


@router.get("/v1/models/{model:path}", name="retrieve_model")
def retrieve_model(model: str, request: Request, tenant: TenantDep) -> dict[str, Any]:
    pools = served_models(request.app.state.gateway.settings).get(model)
    if pools is None:
        raise ApiError(404, "NotFound", f"The model `{model}` does not exist or you do not have access to it.",
                       code="model_not_found")
    return _model(model, pools)
