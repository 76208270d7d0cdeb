"""The one typed request that travels from the producer to the worker.

``InferenceRequest`` is what ``Gateway.submit`` builds after validation and
what ``gateway.infer`` receives: its ``to_body()`` is the Celery task's only
argument (JSON), ``routing_headers()`` the message headers the router reads
without decoding the body.  ``from_body`` re-validates on the worker, so a
message published straight to a queue by anything else fails with a clear
``InvalidRequest`` naming the field instead of a KeyError deep in the task.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from gateway_tasks.core.errors import InvalidRequest
from gateway_tasks.core.tokens import validate_embedding_input
from gateway_tasks.dispatch.lanes import INTERACTIVE, LANES

# message headers (set by the producer and enqueue.lua / pick.lua; read by the router and the task)
HEADER_TENANT = "gt_tenant"
HEADER_TIER = "gt_tier"
HEADER_EST_TOKENS = "gt_est_tokens"
HEADER_SOURCE = "gt_source"
HEADER_TENANT_WEIGHT = "gt_weight"  # the tenant's weight inside its tier (registry, default 1)
HEADER_DEADLINE_S = "gt_deadline_s"  # the request's deadline_s, when it has one (deadline boost)
HEADER_LANE = "gt_lane"              # interactive | scheduled (gateway_tasks.dispatch.lanes)
HEADER_DISPATCH = "gt_dispatch"      # what pick.lua decided (the worker's router): gateway_tasks.dispatch.record.Dispatch
# HTTP header of every upstream call: the task id, so an upstream (or the simulator) can tell
# a retried or duplicated call of one task from another task's (it is not a secret)
UPSTREAM_TASK_ID_HEADER = "X-Gateway-Task-Id"

SOURCES = ("api", "api-sync", "cron", "bench", "demo", "batch")

# the upstream endpoint a task calls: chat completions (messages, max_tokens) or embeddings
# (``input``, no completion: max_tokens 0, its estimate the input's tokens)
CHAT, EMBEDDINGS = "chat", "embeddings"
ENDPOINTS = (CHAT, EMBEDDINGS)


MAX_DEADLINE_S = 7 * 86_400   # a deadline further out is none a queue can act on (submit refuses it)

@dataclass(frozen=True)
class InferenceRequest:
    tenant_id: str
    tier: str
    pool: str
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    prompt_tokens: int
    est_tokens: int
    deadline_s: float | None = None
    source: str = "api"
    extra_body: dict[str, Any] = field(default_factory=dict)
    tenant_weight: float = 1.0
    stream: bool = False     # the worker publishes the upstream's chunks (gateway_tasks.upstream.chunks)
    tenant_tpm: int = 0   # the tenant's TPM quota at submit (0: none): the worker gives back what it did not use
    # what overload changed at submit (gateway_tasks.overload.actions): level,
    # requested_max_tokens, requested_model, requested_pool, failover reason; {} = nothing
    degradation: dict[str, Any] = field(default_factory=dict)
    lane: str = INTERACTIVE   # gateway_tasks.dispatch.lanes: scheduled work queues behind interactive
    # the tier the load level judges it at when above its own: it was submitted on behalf of
    # that tier's task (gateway_tasks.lifecycle.inherit); '' = its own tier
    effective_tier: str = ""
    endpoint: str = CHAT      # CHAT | EMBEDDINGS
    input: Any = None         # an embeddings task's input (gateway_tasks.core.tokens.validate_embedding_input)

    def to_body(self) -> dict[str, Any]:
        """The task argument: a JSON object (never pickle)."""
        return asdict(self)

    def routing_headers(self) -> dict[str, Any]:
        headers = {HEADER_TENANT: self.tenant_id, HEADER_TIER: self.tier,
                   HEADER_EST_TOKENS: self.est_tokens, HEADER_SOURCE: self.source,
                   HEADER_TENANT_WEIGHT: self.tenant_weight, HEADER_LANE: self.lane}
        if self.deadline_s is not None:
            headers[HEADER_DEADLINE_S] = self.deadline_s
        return headers

    def argsrepr(self) -> str:
        """What Flower and logs show instead of the arguments: never the prompt."""
        return (f"tenant={self.tenant_id} tier={self.tier} model={self.model} "
                f"est_tokens={self.est_tokens}")

    @classmethod
    def from_body(cls, body: Any) -> "InferenceRequest":
        """Parse and check a task argument (as the worker receives it)."""
        if not isinstance(body, Mapping):
            raise InvalidRequest(f"the task argument must be an object, got {type(body).__name__}")
        missing = [n for n in ("tenant_id", "tier", "pool", "model", "messages", "max_tokens",
                               "prompt_tokens", "est_tokens") if n not in body]
        if missing:
            raise InvalidRequest(f"the task argument lacks {missing}")
        for name in ("tenant_id", "tier", "pool", "model"):
            _check(isinstance(body[name], str) and body[name] != "", name, body[name], "a non-empty string")
        for name in ("max_tokens", "prompt_tokens", "est_tokens"):
            value = body[name]
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, value,
                   "a non-negative integer")
        endpoint = body.get("endpoint", CHAT)
        _check(endpoint in ENDPOINTS, "endpoint", endpoint, f"one of {list(ENDPOINTS)}")
        messages = body["messages"]
        if endpoint == EMBEDDINGS:
            _check(isinstance(messages, list) and not messages, "messages", "...", "[] for embeddings")
            try:
                validate_embedding_input(body.get("input"))
            except InvalidRequest as exc:
                _check(False, "input", "...", f"an embeddings input ({exc})")
        else:
            _check(body["max_tokens"] > 0, "max_tokens", body["max_tokens"], "> 0")
            _check(isinstance(messages, list) and len(messages) > 0
                   and all(isinstance(m, dict) for m in messages), "messages", "...",
                   "a non-empty list of message objects")
        deadline = body.get("deadline_s")
        _check(deadline is None or (isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
                                    and math.isfinite(deadline) and deadline > 0),
               "deadline_s", deadline, "a positive number of seconds or null")
        source = body.get("source", "api")
        _check(isinstance(source, str), "source", source, "a string")
        extra = body.get("extra_body") or {}
        _check(isinstance(extra, dict), "extra_body", "...", "an object")
        stream = body.get("stream", False)
        _check(isinstance(stream, bool), "stream", stream, "a boolean")
        weight = body.get("tenant_weight", 1.0)
        _check(isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0,
               "tenant_weight", weight, "> 0")
        degradation = body.get("degradation") or {}
        _check(isinstance(degradation, dict), "degradation", "...", "an object")
        lane = body.get("lane", INTERACTIVE)
        _check(lane in LANES, "lane", lane, f"one of {list(LANES)}")
        tpm = body.get("tenant_tpm", 0)
        _check(isinstance(tpm, int) and not isinstance(tpm, bool) and tpm >= 0, "tenant_tpm", tpm,
               "a non-negative integer")
        effective = body.get("effective_tier", "")
        _check(isinstance(effective, str), "effective_tier", effective, "a tier name or ''")
        return cls(tenant_id=body["tenant_id"], tier=body["tier"], pool=body["pool"],
                   model=body["model"], messages=list(messages), max_tokens=body["max_tokens"],
                   prompt_tokens=body["prompt_tokens"], est_tokens=body["est_tokens"],
                   deadline_s=float(deadline) if deadline is not None else None,
                   source=source, extra_body=dict(extra), stream=stream, tenant_weight=float(weight),
                   tenant_tpm=tpm, degradation=dict(degradation), lane=lane, effective_tier=effective,
                   endpoint=endpoint, input=body.get("input") if endpoint == EMBEDDINGS else None)


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise InvalidRequest(f"task argument {name}={value!r} is invalid; expected {expected}")
