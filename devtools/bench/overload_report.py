"""The overload bench's numbers: per-tier rows from the task results, the overload
targets judged on them, and the text report."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

VIP_SERVED_PCT = 99.9
VIP_P99_WAIT_MS = 50.0
UPSTREAM_429_PCT = 0.1
RETURN_HOLDS = 2.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[rank - 1])


def deferral_row(held: int, metas: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """A tier's held deferrals: ``held`` accepted and held, the result metas found of them:
    later run (completed), failed (ended with a reason), lost (never ended)."""
    run = sum(1 for m in metas if m.get("status") == "SUCCESS")
    failed = sum(1 for m in metas if m.get("status") == "FAILURE")
    return {"deferred": held, "later_run": run, "failed": failed, "lost": held - run - failed}


def tier_row(tier: str, submitted: int, deferred: Mapping[str, int], retry_after_s: Sequence[float],
             refused: Mapping[str, int], metas: Sequence[Mapping[str, Any]],
             deferral: Mapping[str, int] | None = None) -> dict[str, Any]:
    """One tier's outcomes; ``submitted`` counts every accepted task, held deferrals included
    (``deferred``: their count by reason; ``deferral``: ``deferral_row``)."""
    done = [m["result"] for m in metas if m.get("status") == "SUCCESS" and isinstance(m.get("result"), dict)]
    failed: dict[str, int] = {}
    for m in metas:
        if m.get("status") == "FAILURE":
            kind = (m.get("result") or {}).get("exc_type", "error") if isinstance(m.get("result"), dict) else "error"
            failed[kind] = failed.get(kind, 0) + 1
    waits = [r["timing"]["queue_wait_ms"] for r in done if r.get("timing", {}).get("queue_wait_ms") is not None]
    degraded = [r for r in done if (r.get("overload") or {}).get("changed")]
    n_deferred = sum(deferred.values())
    return {
        "tier": tier,
        "offered": submitted + sum(refused.values()),
        "submitted": submitted,
        "completed": len(done),
        "failed": sum(failed.values()), "failed_by": failed,
        "deferred": n_deferred, "deferred_by": dict(deferred), "deferred_retry_after_s": list(retry_after_s),
        "deferral": dict(deferral or deferral_row(n_deferred, [])),
        "refused": dict(refused),
        "pending": submitted - len(done) - sum(failed.values()),
        "degraded": len(degraded),
        "capped": sum(1 for r in degraded if r["overload"]["max_tokens"]["capped"]),
        "fallback_model": sum(1 for r in degraded if r["overload"]["model"]["substituted"]),
        "p50_wait_ms": percentile(waits, 50), "p99_wait_ms": percentile(waits, 99),
    }


def return_to_l0_s(result: Mapping[str, Any]) -> float | None:
    """Seconds from the load drop to the level's last return to L0 (0: it was at L0 at the drop
    and stayed there); None: it never came back."""
    drop = result["drop_s"]
    changes = result["level_changes"]
    level_at_drop = 0
    for c in changes:
        if c["t_s"] <= drop:
            level_at_drop = c["to"]
    after = [c for c in changes if c["t_s"] > drop]
    final = after[-1]["to"] if after else level_at_drop
    if final != 0:
        return None
    if not after:
        return 0.0
    return round(after[-1]["t_s"] - drop, 1)


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    tiers = result["tiers"]
    vip = tiers["vip"]
    up = result["upstream"]
    calls = up["requests_ok"] + up["requests_429"] + up["requests_error"]
    pct_429 = 100.0 * up["requests_429"] / calls if calls else 0.0
    vip_served = 100.0 * vip["completed"] / vip["offered"] if vip["offered"] else 100.0
    back = return_to_l0_s(result)
    hold = result["config"]["hold_s"]
    lost = sum(t["pending"] for t in tiers.values())
    targets = {
        "vip_served": {"value_pct": round(vip_served, 3), "target": f">= {VIP_SERVED_PCT} %",
                       "pass": vip_served >= VIP_SERVED_PCT},
        "vip_p99_wait": {"value_ms": vip["p99_wait_ms"], "target": f"< {VIP_P99_WAIT_MS:g} ms",
                         "pass": vip["p99_wait_ms"] is not None and vip["p99_wait_ms"] < VIP_P99_WAIT_MS},
        "upstream_429": {"value_pct": round(pct_429, 3), "target": f"<= {UPSTREAM_429_PCT} % of calls",
                         "pass": pct_429 <= UPSTREAM_429_PCT},
        "back_to_l0": {"value_s": back, "target": f"<= {RETURN_HOLDS:g} hold times ({RETURN_HOLDS * hold:g} s)",
                       "pass": back is not None and back <= RETURN_HOLDS * hold},
        "none_lost": {"value": lost, "target": "every request (held deferrals included) completed or "
                                               "failed with a reason",
                      "pass": lost == 0},
    }
    result["targets"] = targets
    result["upstream"]["calls"] = calls
    result["upstream"]["pct_429"] = round(pct_429, 3)
    result["all_targets_pass"] = all(t["pass"] for t in targets.values())
    return result


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def compact_timeline(timeline: Sequence[Sequence[float]], step_s: float = 5.0) -> str:
    """'L0 L1 L3 ...' one mark per step_s of the run: the level sampled then."""
    marks, next_t = [], 0.0
    for t, level in timeline:
        if t >= next_t:
            marks.append(str(int(level)))
            next_t += step_s
    return "".join(marks)


def format_report(result: Mapping[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"gateway-dev bench-overload: {c['overload_factor']:g}x TPM for {c['overload_s']:g} s, then "
        f"{c['recovery_factor']:g}x for {c['recovery_s']:g} s (pool {c['tpm']} TPM, hold {c['hold_s']:g} s, "
        f"window {c['window_s']:g} s); took {result['runtime_s']:.0f} s",
        "",
        f"{'tier':<7} {'offered':>7} {'done':>6} {'deferred':>8} {'failed':>6} {'lost':>5} "
        f"{'degraded':>8} {'capped':>6} {'fallbk':>6} {'p50 ms':>7} {'p99 ms':>7}",
    ]
    for t in result["tiers"].values():
        lines.append(f"{t['tier']:<7} {t['offered']:>7} {t['completed']:>6} {t['deferred']:>8} {t['failed']:>6} "
                     f"{t['pending']:>5} {t['degraded']:>8} {t['capped']:>6} {t['fallback_model']:>6} "
                     f"{_ms(t['p50_wait_ms']):>7} {_ms(t['p99_wait_ms']):>7}")
    for t in result["tiers"].values():
        if t["deferred_by"]:
            reasons = ", ".join(f"{n} x {why}" for why, n in sorted(t["deferred_by"].items()))
            lines.append(f"  {t['tier']} deferred: {reasons}")
        if t["failed_by"] or t["refused"]:
            lines.append(f"  {t['tier']} failed: {t['failed_by']} refused: {t['refused']}")
    lines += ["", "deferral (accepted and held, released at its retry time or when the level falls):",
              f"  {'tier':<7} {'deferred':>8} {'later run':>9} {'failed':>6} {'lost':>5}"]
    for t in result["tiers"].values():
        d = t.get("deferral") or deferral_row(t["deferred"], [])
        lines.append(f"  {t['tier']:<7} {d['deferred']:>8} {d['later_run']:>9} {d['failed']:>6} {d['lost']:>5}")
    up = result["upstream"]
    lines += ["", f"upstream: {up['calls']} calls, {up['requests_429']} x 429 ({up['pct_429']:.3f} %), "
                  f"{up['requests_error']} errors",
              f"level timeline (one digit per 5 s; the load drops at {result['drop_s']:.0f} s, "
              f"ends at {result['end_s']:.0f} s):",
              "  " + compact_timeline(result["timeline"])]
    for ch in result["level_changes"]:
        lines.append(f"  {ch['t_s']:>6.1f} s  L{ch['from']} -> L{ch['to']}  {ch['reason']}")
    lines += ["", "targets:"]
    for name, t in result["targets"].items():
        value = next(v for k, v in t.items() if k.startswith("value"))
        lines.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {name:<14} {value}  (target {t['target']})")
    return "\n".join(lines)
