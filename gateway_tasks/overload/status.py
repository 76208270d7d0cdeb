"""The deployment's overload status, Flower-independent: the load level in force,
why, since when, the signals it was computed from, the recent level changes,
what each tier gets at this level, and each pool's circuit / drain state.
``gateway status`` prints it, ``GET /v1/status`` answers it (JSON, no secrets)."""

from __future__ import annotations

from typing import Any

import redis

from gateway_tasks.upstream.health import read_health
from gateway_tasks.core.keys import Keys
from gateway_tasks.overload.actions import Request, action_for
from gateway_tasks.overload.deferral import held_counts
from gateway_tasks.overload.state import read_held, read_history, read_state
from gateway_tasks.core.settings import Settings


def tier_actions(settings: Settings, level: int, held: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """What new work of each tier gets at ``level`` (its cell of the degradation table), and
    how many of its deferred tasks are held now."""
    o = settings.overload
    out = {}
    for tier in settings.tiers:
        cell = o.cell(level, tier) if level >= 1 else None
        a = action_for(o, level, tier, Request(0))
        out[tier.name] = {
            "action": a.kind,
            "deferred": a.deferred,
            "retry_after_s": a.retry_after_s if a.deferred else None,
            "reason": a.reason or None,
            "max_tokens_cap": (cell.max_tokens_cap or None) if cell else None,
            "max_tokens": (cell.max_tokens or None) if cell else None,
            "model_fallback": a.fallback,
            "held": (held or {}).get(tier.name, 0),
        }
    return out


def deployment_status(client: redis.Redis, settings: Settings, history: int = 20,
                      tenant_id: str | None = None) -> dict[str, Any]:
    """The load level, its signals, the tiers' actions, the pools and the history; ``held``:
    the tenants held at the level they cause -- every one (the operator's view) or, with
    ``tenant_id``, only that tenant's own entry (a tenant never sees another's id)."""
    keys = Keys(settings.key_prefix)
    state = read_state(client, keys)
    health = read_health(client, keys, settings.pools)
    with client.pipeline(transaction=False) as pipe:
        for pool in settings.pools:
            for tier in settings.tiers:
                pipe.zcard(keys.index(pool.name, tier.name))   # a tier's queue length
        lengths = iter(pipe.execute())
    depths = [{t.name: int(next(lengths)) for t in settings.tiers} for _ in settings.pools]
    now_ms = next(iter(health.values())).now_ms if health else 0
    pools = {}
    for pool, depth in zip(settings.pools, depths):
        h = health[pool.name]
        pools[pool.name] = {
            "circuit": h.circuit, "consecutive_failures": h.failures,
            "circuit_open_for_s": round(max(0, h.open_until_ms - now_ms) / 1000, 3),
            "blocked_for_s": round(max(0, h.blocked_until_ms - now_ms) / 1000, 3),
            "bucket_tokens": round(h.tokens, 1), "token_capacity": pool.token_capacity,
            "backup_pools": list(pool.backup_pools),
            "queued": depth,
        }
    return {
        "level": state.level,
        "enabled": settings.overload.enabled,
        "reason": state.reason,
        "since_ms": state.since_ms or None,
        "decided_ms": state.ts_ms or None,
        "decided_s_ago": round((now_ms - state.ts_ms) / 1000, 3) if state.ts_ms else None,
        "changes": state.changes,
        "signals": state.signals,
        "degradation": settings.overload.degradation,
        "tiers": tier_actions(settings, state.level, held_counts(client, keys, settings.tiers, [p.name for p in settings.pools])),
        "pools": pools,
        "history": read_history(client, keys, history),
        "held": {t: h for t, h in read_held(client, keys).items() if tenant_id is None or t == tenant_id},
    }


def format_status(status: dict[str, Any]) -> str:
    """The status as text for a terminal."""
    lines = [f"load level: L{status['level']}" + ("" if status["enabled"] else " (controller disabled)")]
    if status["decided_s_ago"] is None:
        lines.append("  no decision yet: no worker has run the controller")
    else:
        lines.append(f"  decided {status['decided_s_ago']:.1f} s ago: {status['reason']}")
    sig = status.get("signals") or {}
    if sig.get("utilisation"):
        util = ", ".join(f"{p} {u:.2f}" for p, u in sorted(sig["utilisation"].items()))
        lines.append(f"  utilisation: {util}")
    if sig.get("backlog_s"):
        held = ", ".join(f"{p} {b:.1f} s" for p, b in sorted(sig["backlog_s"].items()))
        lines.append(f"  backlog (queued tokens, in seconds of the pool's TPM): {held}")
    if sig.get("error_rate"):
        err = ", ".join(f"{p} {'-' if e is None else f'{e:.2f}'}" for p, e in sorted(sig["error_rate"].items()))
        lines.append(f"  upstream error rate: {err}")
    if "queue_depth" in sig:
        lines.append(f"  queued: {sig['queue_depth']}")
    lines.append("tiers:")
    for name, a in status["tiers"].items():
        what = []
        if a["deferred"]:
            what.append(f"deferred ({a['reason']}, retry after {a['retry_after_s']:g} s)")
        if a["max_tokens_cap"]:
            what.append(f"max_tokens <= {a['max_tokens_cap']}")
        if a["max_tokens"]:
            what.append(f"max_tokens = {a['max_tokens']}")
        if a["model_fallback"]:
            what.append("fallback model")
        held = f"; {a['held']} deferred held" if a["held"] else ""
        lines.append(f"  {name:<10} {', '.join(what) or 'as requested'}{held}")
    lines.append("pools:")
    for name, p in status["pools"].items():
        extra = ""
        if p["circuit"] != "closed":
            extra += f", open {p['circuit_open_for_s']:g} s more" if p["circuit"] == "open" else ", probing"
        if p["blocked_for_s"]:
            extra += f", held {p['blocked_for_s']:g} s"
        backups = f", backups {','.join(p['backup_pools'])}" if p["backup_pools"] else ""
        lines.append(f"  {name:<10} circuit {p['circuit']}{extra}, bucket {p['bucket_tokens']:.0f}/"
                     f"{p['token_capacity']:.0f} tokens{backups}")
    if status.get("held"):
        lines.append("held tenants (at the level they cause, over their fair share):")
        for name, h in sorted(status["held"].items()):
            lines.append(f"  {name:<10} L{h.get('level')}: {h.get('reason', '')}")
    if status["history"]:
        lines.append("level changes (oldest first):")
        for h in status["history"]:
            lines.append(f"  {h['ts_ms']}  L{h['from']} -> L{h['to']}  {h['reason']}")
    return "\n".join(lines)
