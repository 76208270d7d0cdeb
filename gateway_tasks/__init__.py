"""gateway-tasks: a distributed task queue in front of rate-limited LLM APIs.

The package's folders follow the architecture (dependencies point down):

* ``gateway_tasks.rest``, ``gateway_tasks.cli``, ``gateway_tasks.metrics`` -- interfaces;
* ``gateway_tasks.producer`` -- the Python producer API (``Gateway``);
* ``gateway_tasks.core`` -- settings, Redis key names, errors, tokens, tenants,
  the Lua loader, the producer-side broker and the Celery app;
* ``gateway_tasks.simulator`` -- the OpenAI-compatible upstream simulator
  (`gateway simulate-upstream`);
* ``gateway_tasks.local`` -- the embedded Redis (`gateway redis`), local ports.

The consumer side lives in the top-level ``workers`` package, tenant crons in
``beat``, the Lua scripts in ``lua`` (shipped as ``gateway_tasks.lua``).  The demo,
benchmarks and fault suite are the top-level ``devtools`` package, a distribution of
its own that the runtime never imports.

``from gateway_tasks import Gateway, load_settings`` is the short way in.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Gateway", "TaskHandle", "load_settings"]


def __getattr__(name: str) -> Any:
    # lazy, so importing gateway_tasks.core.* never pulls in the producer (and Celery)
    if name in ("Gateway", "TaskHandle"):
        from gateway_tasks.producer import gateway
        return getattr(gateway, name)
    if name == "load_settings":
        from gateway_tasks.core.settings import load_settings
        return load_settings
    raise AttributeError(name)
