"""Calling an OpenAI-compatible upstream with the official `openai` SDK.

The SDK's own retries are off: retrying is the router's job (a 429 drains the
pool's bucket and requeues at the front of the line; other failures spend the
tier's retry budget)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from gateway_tasks.core.request import UPSTREAM_TASK_ID_HEADER
from gateway_tasks.core.settings import Pool

_clients: dict[tuple[str, str, float], openai.OpenAI] = {}
_lock = threading.Lock()


def client_for(pool: Pool) -> openai.OpenAI:
    key = (pool.base_url, pool.api_key, pool.timeout_s)
    with _lock:
        found = _clients.get(key)
        if found is None:
            found = openai.OpenAI(base_url=pool.base_url, api_key=pool.api_key, max_retries=0,
                                  timeout=pool.timeout_s,
                                  http_client=httpx.Client(timeout=pool.timeout_s,
                                                           limits=httpx.Limits(max_connections=256)))
            _clients[key] = found
        return found


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
    """One chat completion; raises openai.APIStatusError / APIConnectionError / APITimeoutError.
    ``task_id`` travels as the ``X-Gateway-Task-Id`` header (every attempt of a task sends the same)."""
    raw = client_for(pool).chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens, extra_body=extra_body or None,
        extra_headers={UPSTREAM_TASK_ID_HEADER: task_id} if task_id else None)
    completion = raw.parse()
    usage = completion.usage
    return UpstreamReply(body=completion.model_dump(mode="json"), headers=dict(raw.headers),
                         prompt_tokens=usage.prompt_tokens if usage else 0,
                         completion_tokens=usage.completion_tokens if usage else 0)
