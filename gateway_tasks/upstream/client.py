"""Calling an OpenAI-compatible upstream.

Every call goes through the official `openai` SDK, one client per pool.  A chat completion
or an embeddings call is one JSON POST on the SDK client's own request path (``post_json``):
the SDK builds and sends the request and raises its own exception types, and the upstream's
JSON comes back as it sent it.  The typed layer of ``chat.completions.create`` (parameter
transforms, response models) cost a worker about 0.3 ms of CPU per call, a third of a call to
an upstream that answers at once, for nothing the gateway uses.  Streaming uses the typed
layer (its server-sent events; ``chat_stream``).

Nothing retries here: retrying is the router's job (a 429 drains the pool's bucket and
requeues at the front of the line; other failures spend the tier's retry budget).  A 4xx
that is the caller's error (``refusal_of``) is raised as ``UpstreamRejected``, never retried."""

from __future__ import annotations

import importlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import openai

from gateway_tasks.dispatch.request import UPSTREAM_TASK_ID_HEADER
from gateway_tasks.core.errors import ConfigError, UpstreamError, UpstreamRejected
from gateway_tasks.core.settings import Pool

_clients: dict[tuple[str, str, float], openai.OpenAI] = {}
_lock = threading.Lock()
# the HTTP library the installed SDK is built on (httpx2 for openai 3.x, httpx before): the
# client is built with it and its errors are the ones a stream can raise mid-way
SDK_HTTP = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0])
MAX_CONNECTIONS = 256


def client_for(pool: Pool) -> openai.OpenAI:
    if not pool.api_key:
        # a worker checks its pools' keys at start (workers/startup.py); a queue added to it
        # later (`celery control add_consumer`) may name a pool without its key here
        raise ConfigError(pool.key_problem("this worker"))
    key = (pool.base_url, pool.api_key, pool.timeout_s)
    with _lock:
        found = _clients.get(key)
        if found is None:
            found = openai.OpenAI(base_url=pool.base_url, api_key=pool.api_key, max_retries=0,
                                  timeout=pool.timeout_s,
                                  http_client=openai.DefaultHttpxClient(
                                      timeout=pool.timeout_s, limits=SDK_HTTP.Limits(max_connections=MAX_CONNECTIONS)))
            _clients[key] = found
        return found


def post_json(pool: Pool, path: str, body: dict[str, Any], task_id: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """One JSON POST to the pool through its SDK client's own request path (``OpenAI.post``):
    the SDK builds the request (key, headers, timeout) and raises its own exceptions
    (RateLimitError for a 429, InternalServerError for a 5xx, APITimeoutError,
    APIConnectionError...; a caller's 4xx becomes UpstreamRejected), but the body goes as the
    plain dict it is and the answer comes back as the HTTP response, not through the typed
    parameters and response models of ``chat.completions.create``.  Returns the upstream's
    JSON object and its headers; a 2xx without a JSON object is an UpstreamError."""
    try:
        response = client_for(pool).post(f"/{path}", body=body, cast_to=SDK_HTTP.Response,
                                         options={"headers": _task_header(task_id) or {}})
    except openai.APIStatusError as exc:
        refused = refusal_of(exc)
        if refused is None:
            raise
        raise refused from None
    try:
        reply = response.json()
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        raise UpstreamError(f"the upstream answered {response.status_code} without a JSON object")
    return reply, dict(response.headers)


PROCESSING_MS_HEADER = "openai-processing-ms"   # OpenAI's (and the simulator's) own time for the request


def processing_ms(headers: dict[str, str]) -> float | None:
    """The upstream's own time for a request, from its ``openai-processing-ms`` header: the
    part of the call spent at the upstream, the rest being the connection and this process
    (a worker starved of CPU or of the GIL).  None when the header is absent or not a finite
    number >= 0 (another provider, a proxy in between)."""
    raw = headers.get(PROCESSING_MS_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0 <= value < math.inf else None


# 4xx statuses that are not the caller's error: 429 is the pool's rate limit (drain, requeue);
# 401 and 403 refuse the pool's own credential, which the caller cannot fix (and whose
# message may quote part of the key)
NOT_THE_CALLERS = frozenset({401, 403, 429})
UNKNOWN_ERROR_TYPE = "upstream_error"   # the type of a refusal whose body is not OpenAI's error
MAX_UPSTREAM_MESSAGE_CHARS = 1000


def refusal_of(exc: openai.APIStatusError) -> UpstreamRejected | None:
    """The caller's error in an upstream's 4xx (None for a 5xx, 401, 403, 429), with the
    upstream's status and OpenAI error object (``exc.body`` is the object under "error")."""
    status = exc.status_code
    if not 400 <= status < 500 or status in NOT_THE_CALLERS:
        return None
    body = exc.body if isinstance(exc.body, dict) else {}
    text = lambda value: value if isinstance(value, str) else None  # noqa: E731
    message = text(body.get("message")) or (exc.body if isinstance(exc.body, str) else "") or exc.message
    message = message[:MAX_UPSTREAM_MESSAGE_CHARS]
    code = body.get("code")
    return UpstreamRejected(f"the upstream refused the request ({status}): {message}", None, "", status,
                            message, text(body.get("type")) or UNKNOWN_ERROR_TYPE, text(body.get("param")),
                            None if code is None else str(code))


def _task_header(task_id: str) -> dict[str, str] | None:
    return {UPSTREAM_TASK_ID_HEADER: task_id} if task_id else None


def _create(pool: Pool, **params: Any) -> Any:
    """The raw response of one chat.completions call; a 4xx that is the caller's error
    raises UpstreamRejected, every other failure the SDK's own error."""
    try:
        return client_for(pool).chat.completions.with_raw_response.create(**params)
    except openai.APIStatusError as exc:
        refused = refusal_of(exc)
        if refused is None:
            raise
        raise refused from None


@dataclass(frozen=True)
class UpstreamReply:
    body: dict[str, Any]
    headers: dict[str, str]
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def chat(pool: Pool, model: str, messages: list[dict[str, Any]], max_tokens: int,
         extra_body: dict[str, Any] | None = None, task_id: str = "") -> UpstreamReply:
    """One chat completion; raises UpstreamRejected (the caller's 4xx), openai.APIStatusError /
    APIConnectionError / APITimeoutError.  ``task_id`` travels as the ``X-Gateway-Task-Id``
    header (every attempt of a task sends the same)."""
    body, headers = post_json(pool, "chat/completions",
                              {**(extra_body or {}), "model": model, "messages": messages, "max_tokens": max_tokens},
                              task_id)
    usage = body.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    return UpstreamReply(body=body, headers=headers, prompt_tokens=_count(usage, "prompt_tokens"),
                         completion_tokens=_count(usage, "completion_tokens"))


def _count(usage: dict[str, Any], name: str) -> int:
    value = usage.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def embed(pool: Pool, model: str, value: Any, extra_body: dict[str, Any] | None = None,
          task_id: str = "") -> UpstreamReply:
    """One embeddings call; the body as the upstream sent it (``encoding_format`` as the caller
    asked, nothing added), its usage's prompt tokens and no completion.  Errors as ``chat``'s."""
    body, headers = post_json(pool, "embeddings", {**(extra_body or {}), "model": model, "input": value}, task_id)
    usage = body.get("usage")
    prompt = _count(usage, "prompt_tokens") if isinstance(usage, dict) else 0
    return UpstreamReply(body=body, headers=headers, prompt_tokens=prompt, completion_tokens=0)


# -- streaming -------------------------------------------------------------------------
class StreamBroken(UpstreamError):
    """The upstream's stream failed after chunks were already passed on: the call cannot be
    retried (the client has part of the answer); the task fails with it."""


def chat_stream(pool: Pool, model: str, messages: list[dict[str, Any]], max_tokens: int,
                extra_body: dict[str, Any] | None, on_chunk: Callable[[dict[str, Any]], None],
                prompt_tokens: int, task_id: str = "") -> UpstreamReply:
    """One streamed chat completion: every chunk goes to ``on_chunk`` as it arrives; the
    reply is the whole completion assembled from them, its usage from the stream's final
    usage chunk (requested with ``stream_options.include_usage``; counted with tiktoken when
    an upstream sends none).  Errors before the first chunk are those of ``chat`` (so 429s
    requeue as usual); after it, StreamBroken.  ``task_id``: as ``chat``'s."""
    raw = _create(
        pool, model=model, messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body or None,
        extra_headers=_task_header(task_id))
    content: list[str] = []
    first: dict[str, Any] | None = None
    finish: str | None = None
    usage: dict[str, Any] | None = None
    passed = 0
    try:
        for chunk in raw.parse():
            data = chunk.model_dump(mode="json", exclude_unset=True)
            first = first or data
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    content.append(choice.delta.content)
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.model_dump(mode="json", exclude_none=True)
            on_chunk(data)
            passed += 1
    except (openai.APIError, SDK_HTTP.HTTPError) as exc:
        if not passed:
            raise
        raise StreamBroken(f"the upstream's stream broke after {passed} chunks: {exc}") from None
    text = "".join(content)
    if usage is None:
        from gateway_tasks.core.tokens import count_text_tokens
        completion = count_text_tokens(text)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}
    body = {"id": (first or {}).get("id", ""), "object": "chat.completion",
            "created": (first or {}).get("created", 0), "model": (first or {}).get("model", model),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish}],
            "usage": usage}
    return UpstreamReply(body=body, headers=dict(raw.headers),
                         prompt_tokens=int(usage.get("prompt_tokens", 0)),
                         completion_tokens=int(usage.get("completion_tokens", 0)))
