"""What each load level does to a request (pure; the producer applies it at submit,
the worker again at dispatch when the level rose meanwhile):

* L1+ caps ``max_tokens`` of degradable tiers (``Overload.max_tokens_caps``);
* from ``Overload.fallback_from_level`` (L2) degradable tiers go to the model's
  fallback (``Overload.fallback_models``, else the pool's ``fallback_model``);
* a tier with ``defer_from_level`` is refused at submit from that level on:
  ``Deferred`` with the tier's ``defer_retry_after_s`` and the reason in words.

A tier that cannot degrade (vip) keeps its request as sent; a reserved tier is
never deferred (settings refuse ``defer_from_level`` on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from gateway_tasks.core.errors import Deferred
from gateway_tasks.core.settings import Overload, Tier


@dataclass(frozen=True)
class Degradation:
    """A request after its level's actions; ``changed`` when anything differs."""

    level: int
    max_tokens: int
    model: str
    requested_max_tokens: int
    requested_model: str

    @property
    def capped(self) -> bool:
        return self.max_tokens != self.requested_max_tokens

    @property
    def substituted(self) -> bool:
        return self.model != self.requested_model

    @property
    def changed(self) -> bool:
        return self.capped or self.substituted


def degrade(overload: Overload, tier: Tier, level: int, model: str, max_tokens: int,
            fallback_of: Callable[[str], str], served: Callable[[str], bool]) -> Degradation:
    """``model``/``max_tokens`` as the level wants them for ``tier``.  ``fallback_of(model)``
    names the model's fallback ("" = none); ``served(model)`` says whether the caller can
    route to it (the producer: any pool; a worker: the task's own pool)."""
    new_tokens, new_model = max_tokens, model
    if tier.can_degrade and level >= 1:
        cap = overload.cap_at(level)
        if cap:
            new_tokens = min(max_tokens, cap)
        if overload.fallback_from_level and level >= overload.fallback_from_level:
            fallback = fallback_of(model)
            if fallback and served(fallback):
                new_model = fallback
    return Degradation(level, new_tokens, new_model, max_tokens, model)


def deferral(tier: Tier, level: int, reason: str = "") -> Deferred | None:
    """The Deferred error for new work of ``tier`` at ``level``, or None if it is taken."""
    if not tier.defer_from_level or level < tier.defer_from_level:
        return None
    why = f"load level L{level}: new {tier.name} work is deferred from L{tier.defer_from_level} on"
    if reason:
        why += f" ({reason})"
    return Deferred(f"{why}; retry after {tier.defer_retry_after_s:g} s",
                    retry_after_s=tier.defer_retry_after_s, reason=why, level=level)


def record(submitted: dict[str, Any] | None, level_at_dispatch: int, *, max_tokens: int, model: str,
           pool: str, requested_pool: str, failover: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the result says was changed for the request (``submitted``: the producer's
    record, ``InferenceRequest.degradation``)."""
    sub = submitted or {}
    requested_tokens = int(sub.get("requested_max_tokens", max_tokens))
    requested_model = str(sub.get("requested_model", model))
    out: dict[str, Any] = {
        "level_at_submit": int(sub.get("level", 0)),
        "level_at_dispatch": level_at_dispatch,
        "max_tokens": {"requested": requested_tokens, "used": max_tokens,
                       "capped": max_tokens != requested_tokens},
        "model": {"requested": requested_model, "used": model,
                  "substituted": model != requested_model},
        "pool": {"requested": requested_pool, "used": pool, "failover": pool != requested_pool},
    }
    if failover:
        out["failover"] = failover
    out["changed"] = (out["max_tokens"]["capped"] or out["model"]["substituted"]
                      or out["pool"]["failover"])
    return out
