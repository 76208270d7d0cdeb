"""REST for tenant crons: the calling tenant registers, lists and deletes its own.

    POST   /v1/crons              201 created / 200 updated: the cron's row
    GET    /v1/crons              {"crons": [row, ...]}  (the caller's only)
    GET    /v1/crons/{task_id}    the row, 404 if the caller has no such cron
    DELETE /v1/crons/{task_id}    204, 404 if the caller has no such cron

A row carries the jitter offset and both next times: ``nominal_next`` (when
the expression next matches) and ``actual_next`` (``nominal_next`` plus
``jitter_offset_s``, when the run really fires).  Crons are keyed by
(tenant, task id) and the tenant is always the authenticated one, so another
tenant's cron is simply not there: 404, exactly like an unknown id.

The work is done by ``beat.api`` (the same calls as ``gateway cron ...``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway_tasks.core.errors import ApiError
from gateway_tasks.rest.auth import TenantDep
from gateway_tasks.rest.models import ChatMessage, prompt_to_messages

from beat.api import delete_cron, get_cron, list_crons, register_cron

router = APIRouter(tags=["crons"])


class CronRequest(BaseModel):
    """POST /v1/crons: create or update (same task_id) one of the caller's crons."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$",
                         description="the tenant's own name for the cron (1-128 of A-Z a-z 0-9 _ . -)")
    cron: str = Field(min_length=1, max_length=256,
                      description="5-field cron expression in UTC ('0 * * * *') or @hourly, @daily, ...")
    messages: list[ChatMessage] = Field(
        min_length=1, description="what each run submits; a plain string is one user message")
    model: str | None = Field(default=None, min_length=1,
                              description="a model served by one of the pools (default: first pool's)")
    max_tokens: int | None = Field(default=None, gt=0, strict=True,
                                   description="completion token limit of each run")

    _messages = field_validator("messages", mode="before")(prompt_to_messages)

    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"messages": [m.model_dump() for m in self.messages]}
        if self.model is not None:
            out["model"] = self.model
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        return out


class CronRow(BaseModel):
    """One cron as stored, with its next run (times are ISO 8601 UTC)."""

    tenant_id: str
    task_id: str
    cron: str = Field(description="the expression, whitespace normalised")
    tier: str = Field(description="the tenant's tier: it sets the jitter window")
    jitter_offset_s: int = Field(description="seconds between each nominal time and the real run: "
                                             "sha256('<tenant>:<task_id>') mod the tier's jitter "
                                             "window, capped below the cron period")
    nominal_next: str | None = Field(description="when the expression next matches")
    actual_next: str | None = Field(description="nominal_next + jitter_offset_s: when it fires")
    last_fired: str | None = Field(description="when the last run was fired (null: never)")
    last_status: str | None = Field(description="fired, quota, misfire, deferred, fire_error, ... (null: never)")
    last_task_id: str | None = Field(description="the task id of the last run "
                                                 "(GET /v1/tasks/{id} shows its result)")
    retry_at: str | None = Field(None, description="when a run the load level deferred is tried "
                                                   "again (null: none pending)")


class CronList(BaseModel):
    crons: list[CronRow]


_NOT_FOUND = {404: {"description": "the calling tenant has no cron with this task_id"}}


def _not_found(task_id: str) -> ApiError:
    return ApiError(404, "NotFound", f"no cron {task_id!r} for this tenant")


@router.post("/v1/crons", name="put_cron", response_model=CronRow, status_code=201,
             responses={200: {"model": CronRow, "description": "an existing cron was updated"},
                        201: {"description": "the cron was created"},
                        400: {"description": "malformed expression, task id or payload, a payload "
                                              "a submit would refuse (unknown model, max_tokens), "
                                              "or over the tier's cron count or hourly fires "
                                              "(CronLimitExceeded: limit, allowed, requested)"},
                        413: {"description": "the prompt plus max_tokens is over max_prompt_tokens "
                                             "or the pool's capacity"},
                        503: {"description": "Redis is unavailable or full: nothing was registered"}})
def put_cron(body: CronRequest, request: Request, response: Response,
             tenant: TenantDep) -> dict[str, Any]:
    """Register a cron for the calling tenant, or update its cron of the same task_id
    (an update keeps its history and never re-fires a run already fired)."""
    gateway = request.app.state.gateway
    existed = get_cron(gateway.settings, gateway.r, tenant.tenant_id, body.task_id) is not None
    row = register_cron(gateway.settings, gateway.r, tenant.tenant_id, body.task_id, body.cron,
                        body.payload(), gateway=gateway)
    response.status_code = 200 if existed else 201
    response.headers["Location"] = request.url_for("get_cron", task_id=body.task_id).path
    return row


@router.get("/v1/crons", name="list_crons", response_model=CronList)
def get_crons(request: Request, tenant: TenantDep) -> dict[str, Any]:
    """The calling tenant's crons, sorted by task_id."""
    gateway = request.app.state.gateway
    return {"crons": list_crons(gateway.settings, gateway.r, tenant.tenant_id)}


@router.get("/v1/crons/{task_id}", name="get_cron", response_model=CronRow, responses=_NOT_FOUND)
def get_one(task_id: str, request: Request, tenant: TenantDep) -> dict[str, Any]:
    """One of the calling tenant's crons."""
    gateway = request.app.state.gateway
    row = get_cron(gateway.settings, gateway.r, tenant.tenant_id, task_id)
    if row is None:
        raise _not_found(task_id)
    return row


@router.delete("/v1/crons/{task_id}", name="delete_cron", status_code=204, responses=_NOT_FOUND)
def remove(task_id: str, request: Request, tenant: TenantDep) -> Response:
    """Delete one of the calling tenant's crons; its pending run is not fired."""
    gateway = request.app.state.gateway
    if not delete_cron(gateway.settings, gateway.r, tenant.tenant_id, task_id, missing_ok=True):
        raise _not_found(task_id)
    return Response(status_code=204)
