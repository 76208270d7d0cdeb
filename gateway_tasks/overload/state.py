"""The deployment's load level as stored in Redis (``Keys.overload_state``, written
only by lua/overload/commit.lua from the workers' controller), read by the
producer (deferral, degradation), the worker (degradation at dispatch), the
metrics and ``gateway status`` / ``GET /v1/status``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.levels import NEVER, Seen
from gateway_tasks.core.settings import MAX_LEVEL

HISTORY_MAX = 500   # level changes kept (newest first)


def seen_field(level: int) -> str:
    return f"seen:{level}"


@dataclass(frozen=True)
class LoadState:
    level: int = 0
    version: int = 0
    ts_ms: int = 0          # the last decision (Redis clock); 0 = the controller never ran
    since_ms: int = 0       # when the level in force was entered
    reason: str = ""
    seen: Seen = NEVER
    changes: int = 0        # level changes since the state began
    signals: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "since_ms": self.since_ms, "decided_ms": self.ts_ms,
                "reason": self.reason, "changes": self.changes, "signals": self.signals}


def _int(value: bytes | None, default: int = 0) -> int:
    try:
        return int(float(value)) if value is not None else default
    except ValueError:
        return default


def parse_state(raw: dict[bytes, bytes]) -> LoadState:
    get = lambda name: raw.get(name.encode())  # noqa: E731
    seen = tuple((None if get(seen_field(k)) in (None, b"") else _int(get(seen_field(k))))
                 for k in range(1, MAX_LEVEL + 1))
    try:
        signals = json.loads(get("signals") or b"{}")
    except ValueError:
        signals = {}
    level = min(MAX_LEVEL, max(0, _int(get("level"))))
    return LoadState(level, _int(get("version")), _int(get("ts_ms")), _int(get("since_ms")),
                     (get("reason") or b"").decode(), seen, _int(get("changes")), signals)


def read_state(client: redis.Redis, keys: Keys) -> LoadState:
    return parse_state(client.hgetall(keys.overload_state))


def read_level(client: redis.Redis, keys: Keys) -> int:
    """The level in force (L0 when the controller never ran)."""
    return min(MAX_LEVEL, max(0, _int(client.hget(keys.overload_state, "level"))))


def tenant_level(level: int, reason: str, held: bytes | str | None) -> tuple[int, str]:
    """The level a tenant's new work sees: the deployment's, or the level the tenant is held
    at (its entry in ``Keys.overload_held``: gateway_tasks/overload/attribution.py) when higher."""
    if not held:
        return level, reason
    try:
        entry = json.loads(held)
        own = min(MAX_LEVEL, max(0, int(entry["level"])))
    except (ValueError, KeyError, TypeError):
        return level, reason
    if own <= level:
        return level, reason
    return own, str(entry.get("reason") or f"this tenant is held at L{own}")


def read_held(client: redis.Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    """The tenants held at the level they cause: tenant -> {level, until_ms, reason}."""
    out = {}
    for tenant, raw in client.hgetall(keys.overload_held).items():
        try:
            out[tenant.decode()] = json.loads(raw)
        except ValueError:
            continue
    return out


def read_history(client: redis.Redis, keys: Keys, n: int = 50) -> list[dict[str, Any]]:
    """The last ``n`` level changes, oldest first."""
    out = []
    for raw in reversed(client.lrange(keys.overload_history, 0, max(0, n - 1))):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out
