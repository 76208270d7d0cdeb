"""Warming a worker up before it takes its first task.

The `openai` SDK does one-time work on a process's first chat completion (its
resource objects, its request building and HTTP client: ~0.2 s on a quiet
machine, seconds on a loaded one).  A worker that has just started -- a
restart, or a pod the autoscaler added because a wave is coming -- would do it
inside its first upstream calls, with every task picked meanwhile holding a
slot.  On a loaded 2-core machine the overload bench saw a fresh worker's first
28 calls (vip among them) all finish together ~4 s after dispatch, nothing
dispatched in between, and a vip p99 wait of 3-5 s; part of that stall was
the simulator's own first request (tiktoken's encoder, now loaded at its start).

So the worker, on ``worker_init`` (after its modules are imported, before its
consumer starts), runs one complete SDK call -- a ``with_raw_response`` create, as a
streamed chat completion goes through the SDK -- against an in-process fake transport (the
SDK's HTTP library's ``MockTransport``): no network, no upstream tokens, no rate limit
touched.  It also builds each pool's real SDK client.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import openai
from celery.signals import worker_init, worker_ready

from gateway_tasks.core.celery_app import settings_of
from gateway_tasks.core.settings import Settings
from gateway_tasks.upstream.client import SDK_HTTP

log = logging.getLogger(__name__)

WARMUP_MODEL = "warmup"
_REPLY = {
    "id": "chatcmpl-warmup", "object": "chat.completion", "created": 0, "model": WARMUP_MODEL,
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def _reply(request: Any) -> Any:
    return SDK_HTTP.Response(200, json=_REPLY, headers={"x-ratelimit-remaining-tokens": "1"})


def warm_sdk() -> dict[str, Any]:
    """One chat completion through the SDK against a fake in-process transport; returns
    the warm reply's JSON body, for the tests."""
    with SDK_HTTP.Client(transport=SDK_HTTP.MockTransport(_reply)) as http:
        client = openai.OpenAI(base_url="http://warmup.invalid/v1", api_key="warmup", max_retries=0,
                               http_client=http)
        raw = client.chat.completions.with_raw_response.create(
            model=WARMUP_MODEL, messages=[{"role": "user", "content": "warm up"}], max_tokens=1)
        return raw.http_response.json()


def warm_worker(settings: Settings) -> float:
    """Warm the SDK and build the client of every pool with its key here; seconds it took.
    Never raises: a worker that could not warm up still works, it is only slower on its
    first calls."""
    from gateway_tasks.upstream.client import client_for
    started = time.monotonic()
    try:
        warm_sdk()
        for pool in settings.pools:
            if not pool.api_key:   # a pool this worker does not call (workers/startup.py)
                continue
            client_for(pool).chat.completions   # noqa: B018 -- builds the resource objects
    except Exception as exc:  # noqa: BLE001 -- see the docstring
        log.warning("worker warm-up failed (the first upstream calls will be slower): %s",
                    type(exc).__name__)
    return time.monotonic() - started


_took_s: list[float] = []   # this process's warm-up, logged once logging is set up


@worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        _took_s.append(warm_worker(settings_of(app)))


@worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    # (Celery configures logging after worker_init: the figure is logged here)
    if _took_s:
        log.info("worker warmed up in %.2f s before taking tasks (openai SDK, pool clients)", _took_s[-1])
