"""Injected upstream faults for a while (``POST /faults``), for `gateway-dev chaos`.

``{"mode": MODE, "for_s": seconds}`` -- until then every chat request gets:

* ``error_500``: a 500 ``server_error`` at once, nothing charged;
* ``timeout``: no answer for ``hang_s`` (default 60 s: past the client's timeout),
  then a 504; nothing charged;
* ``rate_limit``: a 429 with ``Retry-After`` (``retry_after_s``, default 1 s);
* ``rate_limit_bare``: a 429 without any Retry-After or x-ratelimit-reset header.

``{"mode": "none"}`` ends a fault early.  Connection refused is not a mode: the
fault run stops the simulator process and starts it again on the same port.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway_tasks.core.errors import ApiError, ConfigError

MODES = ("none", "error_500", "timeout", "rate_limit", "rate_limit_bare")


@dataclass
class Fault:
    mode: str = "none"
    until_monotonic: float = 0.0
    hang_s: float = 60.0
    retry_after_s: float = 1.0

    def active(self, now_s: float | None = None) -> str:
        """The fault mode in force now ('none' once it is over)."""
        now_s = time.monotonic() if now_s is None else now_s
        return self.mode if self.mode != "none" and now_s < self.until_monotonic else "none"

    def describe(self) -> dict[str, Any]:
        left = max(0.0, self.until_monotonic - time.monotonic())
        return {"mode": self.active(), "left_s": round(left, 3) if self.active() != "none" else 0.0}


def fault_from_json(body: Any) -> Fault:
    """A Fault from a POST /faults body; ConfigError naming what is wrong."""
    if not isinstance(body, dict):
        raise ConfigError("a fault is a JSON object {mode, for_s, ...}")
    mode = body.get("mode", "none")
    if mode not in MODES:
        raise ConfigError(f"fault mode {mode!r} is unknown; expected one of {', '.join(MODES)}")
    numbers = {}
    for name, default in (("for_s", 0.0), ("hang_s", 60.0), ("retry_after_s", 1.0)):
        value = body.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"fault {name}={value!r} must be a number >= 0")
        numbers[name] = float(value)
    return Fault(mode, time.monotonic() + numbers["for_s"], numbers["hang_s"], numbers["retry_after_s"])


def fault_error(mode: str, fault: Fault) -> ApiError:
    """The error answer of an active fault mode (timeout: after the hang)."""
    if mode == "error_500":
        return ApiError(500, "server_error", "The simulator injected a server error (fault).",
                        code="injected_fault")
    if mode == "timeout":
        return ApiError(504, "server_error", "The simulator hung past the timeout (fault).",
                        code="injected_fault")
    if mode == "rate_limit":
        return ApiError(429, "requests", "Rate limit reached (injected 429 storm).",
                        headers={"retry-after": f"{fault.retry_after_s:g}",
                                 "retry-after-ms": str(int(fault.retry_after_s * 1000))},
                        code="rate_limit_exceeded")
    return ApiError(429, "requests", "Rate limit reached (injected 429 storm, no Retry-After).",
                    code="rate_limit_exceeded")
