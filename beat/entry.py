"""One tenant cron: its definition, validation and its Redis hash form.

The entry id is ``f"{tenant_id}:{task_id}"``; ``task_id`` is the tenant's own
name for the cron.  The payload is what each run submits through the gateway:
``{"messages": [...], "model": optional, "max_tokens": optional}``.  The hash
stores JSON only.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from gateway_tasks.core.errors import CronError
from gateway_tasks.tenants.registry import TENANT_ID_RE

TASK_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
PAYLOAD_KEYS = ("messages", "model", "max_tokens")
TIMEZONE = "UTC"


INT_FIELDS = ("window_s", "period_s", "jitter_offset_s", "next_nominal_ms", "next_fire_ms",
              "created_ms", "updated_ms", "settled_nominal_ms", "last_nominal_ms",
              "last_fire_ms", "last_skip_ms", "fired_count", "skipped_count", "retry_at_ms")


def entry_id(tenant_id: str, task_id: str) -> str:
    return f"{tenant_id}:{task_id}"


def new_run_secret() -> str:
    """A cron's run secret (128 random bits): what its runs' ids are derived from
    (``beat.fire.run_key``), kept for the cron's life, never shown."""
    return secrets.token_hex(16)


def validate_ids(tenant_id: str, task_id: str) -> None:
    if not isinstance(tenant_id, str) or not TENANT_ID_RE.match(tenant_id):
        raise CronError(f"tenant id {tenant_id!r} is invalid: use 1-128 of A-Z a-z 0-9 _ . - "
                        "starting with a letter or digit")
    if not isinstance(task_id, str) or not TASK_ID_RE.match(task_id):
        raise CronError(f"cron task id {task_id!r} is invalid: use 1-128 of A-Z a-z 0-9 _ . -")


def validate_payload(payload: Any) -> dict[str, Any]:
    """A normalised copy of the payload; CronError saying what is wrong."""
    if not isinstance(payload, Mapping):
        raise CronError(f"cron payload must be an object with 'messages', got {type(payload).__name__}")
    unknown = sorted(set(payload) - set(PAYLOAD_KEYS))
    if unknown:
        raise CronError(f"cron payload has unknown keys {unknown}; allowed: {list(PAYLOAD_KEYS)}")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise CronError("cron payload needs a non-empty 'messages' list, "
                        "e.g. [{'role': 'user', 'content': 'Summarise the news'}]")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or "content" not in message:
            raise CronError(f"cron payload messages[{i}] must be an object with 'role' and "
                            f"'content', got {message!r}")
    out: dict[str, Any] = {"messages": [dict(m) for m in messages]}
    model = payload.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise CronError(f"cron payload 'model' must be a non-empty string, got {model!r}")
        out["model"] = model
    max_tokens = payload.get("max_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise CronError(f"cron payload 'max_tokens' must be a positive integer, got {max_tokens!r}")
        out["max_tokens"] = max_tokens
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise CronError(f"cron payload is not JSON-serialisable: {exc}") from None
    return out


@dataclass
class CronEntry:
    tenant_id: str
    task_id: str
    cron: str
    payload: dict[str, Any]
    tier: str
    window_s: int            # the tier's jitter window when last computed
    period_s: int            # smallest gap between nominal times
    jitter_offset_s: int
    next_nominal_ms: int
    next_fire_ms: int        # next_nominal_ms + jitter offset (the sorted-set score)
    timezone: str = TIMEZONE
    created_ms: int = 0
    updated_ms: int = 0
    settled_nominal_ms: int | None = None   # latest nominal fired or skipped
    last_status: str | None = None          # fired / quota / misfire / deferred / fire_error / ...
    last_nominal_ms: int | None = None      # nominal time of the last fired run
    last_fire_ms: int | None = None         # when it was fired
    last_task_id: str | None = None
    last_error: str | None = None
    last_skip_ms: int | None = None
    fired_count: int = 0
    skipped_count: int = 0
    retry_at_ms: int = 0     # when a deferred run is tried again (beat.engine); 0: none pending
    run_secret: str = field(default="", repr=False, compare=False)   # beat.fire.run_key; "" until stored
    tenant_gen: str = field(default="", compare=False)   # the tenant generation that registered it
    extra: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def entry_id(self) -> str:
        return entry_id(self.tenant_id, self.task_id)

    def of_generation(self, gen: str) -> bool:
        """Whether the tenant generation ``gen`` registered it (entries from before
        generations, or of a tenant without one, belong to whichever holds the id)."""
        return not self.tenant_gen or not gen or self.tenant_gen == gen

    def definition_fields(self) -> dict[str, str]:
        """The hash fields (re)written on registration; last_* fields are left alone
        and the payload has its own key."""
        return {
            "tenant_id": self.tenant_id, "task_id": self.task_id, "cron": self.cron,
            "timezone": self.timezone,
            "tier": self.tier, "window_s": str(self.window_s), "period_s": str(self.period_s),
            "jitter_offset_s": str(self.jitter_offset_s),
            "next_nominal_ms": str(self.next_nominal_ms), "next_fire_ms": str(self.next_fire_ms),
            "created_ms": str(self.created_ms), "updated_ms": str(self.updated_ms),
            **({"run_secret": self.run_secret} if self.run_secret else {}),
            **({"tenant_gen": self.tenant_gen} if self.tenant_gen else {}),
        }

    def payload_json(self) -> str:
        """The payload as stored (its own key, see ``Keys.cron_payload``)."""
        return json.dumps(self.payload, separators=(",", ":"))

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str],
                  payload: bytes | str | None = None) -> "CronEntry":
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            if name not in known or name == "extra":
                continue
            if name in INT_FIELDS:
                kwargs[name] = int(value)
            elif name == "payload":
                kwargs[name] = json.loads(value)
            elif name.startswith("last_") and value == "":
                kwargs[name] = None
            else:
                kwargs[name] = value
        kwargs["extra"] = {k: v for k, v in d.items() if k not in known}
        kwargs.setdefault("payload", json.loads(payload) if payload else {})
        return cls(**kwargs)
