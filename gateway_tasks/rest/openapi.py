"""The REST API's OpenAPI schema as the API really answers.

FastAPI documents a 422 ``HTTPValidationError`` on every operation with
parameters or a body; this API answers schema errors and malformed JSON with
400 and its one error body (gateway_tasks.rest.errors).  ``install_openapi``
replaces those with the responses each operation can give -- 400, 401 (every
operation but the public ones), 404, 413 (bodies), 429 (submits), 503 (Redis
unavailable), and for the synchronous chat endpoint 502/504 and the upstream's
own 4xx it passes through (400, 404, 409, 413, 422: the OpenAI error object
``{message, type, param, code}`` as the upstream sent it) -- all with the
``Error`` body, so a schema-driven client or fuzzer (tests/test_security_fuzz.py)
can check every answer against it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway_tasks.core.settings import Settings
from gateway_tasks.core.tokens import MIN_PROMPT_TOKENS
from gateway_tasks.rest.auth import PUBLIC, TENANT, access_of

ERROR_REF = {"$ref": "#/components/schemas/Error"}
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Error",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["type", "message"],
        "properties": {"type": {"type": "string", "description": "the error class, e.g. ValidationError; "
                                "in an upstream's refusal its OpenAI type, e.g. invalid_request_error"},
                       "message": {"type": "string"},
                       "param": {"type": ["string", "null"],
                                 "description": "an upstream's refusal: the parameter it names"},
                       "code": {"type": ["string", "null"],
                                "description": "an upstream's refusal: its code, e.g. context_length_exceeded"}},
        "additionalProperties": True}},
}
BODY_METHODS = ("post", "put", "patch")
_DESCRIPTIONS = {
    "400": "invalid request: schema errors, malformed JSON, bad values (ValidationError, InvalidRequest)",
    "401": "missing or invalid credential (Unauthorized)",
    "404": "no such resource for this caller (NotFound; another tenant's ids answer the same)",
    "409": "the task was cancelled before it completed (TaskCancelled)",
    "413": "request body over max_request_bytes, or prompt too large (RequestTooLarge, PromptTooLarge)",
    "422": "the upstream could not process the request",
    "429": "queue full or quota reached (QueueFull, QuotaExceeded); see Retry-After",
    "502": "the upstream failed or rejected the task (UpstreamError)",
    "503": "Redis unavailable (ServiceUnavailable); see Retry-After",
    "504": "the task did not complete in time (Timeout, DeadlineExceeded)",
}
SYNC_PATHS = frozenset({"/v1/chat/completions"})
# the upstream's 4xx a synchronous call passes through with the upstream's error object
# (not 401/403: the pool's credential; not 429: the gateway drains and retries)
UPSTREAM_PASSED_THROUGH = ("400", "404", "409", "413", "422")
_PASSED_THROUGH_NOTE = ("; or the upstream refused the request: its status and OpenAI error object "
                        "{message, type, param, code} as it sent them, never retried")


def _error_response(code: str, path: str = "") -> dict[str, Any]:
    description = _DESCRIPTIONS[code]
    if path in SYNC_PATHS and code in UPSTREAM_PASSED_THROUGH:
        description += _PASSED_THROUGH_NOTE
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


def error_codes(path: str, method: str) -> list[str]:
    """The error statuses one operation documents."""
    access = access_of(path)
    if access == PUBLIC:
        return ["503"]
    codes = ["400", "401", "404", "503"]
    if method in BODY_METHODS:
        codes.append("413")
        if access == TENANT:
            codes.append("429")
    if path in SYNC_PATHS:
        codes += ["502", "504", *UPSTREAM_PASSED_THROUGH]
    return sorted(set(codes))


def rewrite(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace FastAPI's 422 responses with the API's own error responses (in place)."""
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code in error_codes(path, method):
                # a route's own description of an error status keeps its words, gets the body
                given = responses.setdefault(code, _error_response(code, path))
                given.setdefault("content", {"application/json": {"schema": ERROR_REF}})
            for code, given in responses.items():   # a route's own error statuses: the body too
                if code[:1] in ("4", "5"):
                    given.setdefault("content", {"application/json": {"schema": ERROR_REF}})
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["Error"] = ERROR_SCHEMA
    return schema


MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


def bound_max_tokens(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Every body's max_tokens gets the maximum submit enforces: max_prompt_tokens less the
    smallest prompt (MIN_PROMPT_TOKENS); above it every request is refused (PromptTooLarge)."""
    maximum = settings.max_prompt_tokens - MIN_PROMPT_TOKENS
    for model in schema.get("components", {}).get("schemas", {}).values():
        for name in MAX_TOKENS_FIELDS:
            prop = model.get("properties", {}).get(name)
            if prop is None:
                continue
            for variant in prop.get("anyOf", [prop]):
                if variant.get("type") == "integer":
                    variant["maximum"] = maximum
    return schema


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Serve the rewritten schema at /openapi.json (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = bound_max_tokens(rewrite(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes)),
                settings)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
