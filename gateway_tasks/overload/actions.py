"""What each load level does to a request: the degradation table (pure, table-tested).

``action_for(overload, level, tier, request)`` is the one look-up: the table's cell for the
tier at the level (``Overload.cell``: the configured ``[overload.actions]`` cell, else the
``Overload.degradation`` preset's; none = execute as requested) applied to the request:

* ``execute``: max_tokens = min(requested, cap), or a fixed max_tokens, and the model's
  fallback when the cell says ``model = "fallback"`` (only a tier that ``can_degrade``);
* ``defer``: not run now -- ``retry_after_s`` and a reason code (``capacity_pressure``,
  ``system_overload``); the producer holds it (gateway_tasks/overload/deferral.py) or, when
  the caller asked for a refusal, raises ``deferral_error``.

The producer applies it at submit with the tenant's tier (or the tier the work is judged
at); the worker again at dispatch with ``at_dispatch`` (``dispatch_action``): work already
accepted is never deferred there, and its max_tokens never rises.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from gateway_tasks.core.errors import Deferred
from gateway_tasks.core.settings import DEFER, EXECUTE, FALLBACK, Overload, Tier


@dataclass(frozen=True)
class Request:
    """What the table looks at in a request."""

    max_tokens: int
    model: str = ""


@dataclass(frozen=True)
class Action:
    """A request's action at a level: ``kind`` execute (with ``max_tokens`` and ``fallback``)
    or defer (with ``retry_after_s`` and the ``reason`` code)."""

    kind: str
    level: int
    tier: str
    max_tokens: int
    fallback: bool = False
    retry_after_s: float = 0.0
    reason: str = ""

    @property
    def deferred(self) -> bool:
        return self.kind == DEFER


def action_for(overload: Overload, level: int, tier: Tier, request: Request) -> Action:
    """The action for new work of ``tier`` at ``level``."""
    cell = overload.cell(level, tier) if level >= 1 else None
    if cell is None:
        return Action(EXECUTE, level, tier.name, request.max_tokens)
    if cell.action == DEFER:
        return Action(DEFER, level, tier.name, request.max_tokens, retry_after_s=float(cell.retry_after_s),
                      reason=cell.reason)
    tokens = request.max_tokens
    if cell.max_tokens_cap:
        tokens = min(tokens, cell.max_tokens_cap)
    elif cell.max_tokens:
        tokens = cell.max_tokens
    return Action(EXECUTE, level, tier.name, tokens, fallback=cell.model == FALLBACK and tier.can_degrade)


def dispatch_action(overload: Overload, level: int, tier: Tier, request: Request) -> Action:
    """The action at dispatch for work accepted earlier: the level's execute cell, or for a
    level that defers the tier, the nearest lower level's; max_tokens only ever lowered."""
    for k in range(level, 0, -1):
        a = action_for(overload, k, tier, request)
        if not a.deferred:
            return replace(a, level=level, max_tokens=min(a.max_tokens, request.max_tokens))
    return Action(EXECUTE, level, tier.name, request.max_tokens)


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
            fallback_of: Callable[[str], str], served: Callable[[str], bool], *,
            at_dispatch: bool = False) -> Degradation:
    """``model``/``max_tokens`` as the level's execute action wants them for ``tier`` (a
    defer leaves them as they are: see ``action_for``).  ``fallback_of(model)`` names the
    model's fallback ("" = none); ``served(model)`` says whether the caller can route to it
    (the producer: any pool; a worker: the task's own pool)."""
    look = dispatch_action if at_dispatch else action_for
    a = look(overload, level, tier, Request(max_tokens, model))
    if a.deferred:
        return Degradation(level, max_tokens, model, max_tokens, model)
    new_model = model
    if a.fallback:
        fallback = fallback_of(model)
        if fallback and served(fallback):
            new_model = fallback
    return Degradation(level, a.max_tokens, new_model, max_tokens, model)


def deferral_sentence(action: Action, why: str = "") -> str:
    """The human sentence of a deferral (its code is ``action.reason``)."""
    out = f"load level L{action.level}: new {action.tier} work is deferred ({action.reason})"
    return out + (f": {why}" if why else "")


def deferral_error(action: Action, why: str = "") -> Deferred:
    """The refusal of a deferred request (the caller asked for one): ``Deferred`` with the
    retry time, the reason code and the level; its message is the sentence."""
    return Deferred(f"{deferral_sentence(action, why)}; retry after {action.retry_after_s:g} s",
                    retry_after_s=action.retry_after_s, reason=action.reason, level=action.level)


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
