"""`gateway-dev bench-fairness`, part 2: per-tenant numbers, the targets, the text.

Pure: it works on the results the run collected (``timing.queue_wait_ms`` and
``tokens.total`` of each task's result) and on the flood window's upstream
accounting (``bench.utilisation``).  The targets of issue "Router v2":

* every quiet tenant's queue-wait p99 < 1 s while the flooder is backlogged
  (a request never answered counts as an infinite wait);
* the pool >= 95 % utilised during the flood (quota really used, see
  ``bench.utilisation``; the naive served/quota figure is printed beside it).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from devtools.bench import targets as bench_targets
from devtools.bench.load import wait_stats

QUIET_P99_MS = 1000.0
UTILISATION_MIN_PCT = 95.0
FLOODER, QUIET = "flooder", "quiet"


def tenant_row(tenant: str, role: str, sent: int, results: Sequence[Mapping[str, Any]],
               window_s: float) -> dict[str, Any]:
    """One tenant's requests, queue waits and tokens (requests without a result: never)."""
    waits = [r["timing"]["queue_wait_ms"] for r in results
             if r.get("timing", {}).get("queue_wait_ms") is not None]
    tokens = sum(int(r.get("tokens", {}).get("total") or 0) for r in results)
    row = {"tenant": tenant, "role": role, "sent": sent, "completed": len(results),
           "tokens": tokens,
           "tokens_per_s": round(tokens / window_s, 1) if window_s > 0 else None}
    row.update(wait_stats(waits, missing=max(0, sent - len(waits))))
    return row


def worst_quiet(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The quiet tenant with the largest p99 (one never served is the worst)."""
    quiet = [r for r in rows if r["role"] == QUIET]
    if not quiet:
        return None
    return max(quiet, key=lambda r: float("inf") if r["wait_p99_ms"] is None else r["wait_p99_ms"])


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    """Adds ``targets`` and ``all_targets_pass`` to a run's result."""
    worst = worst_quiet(result["tenants"])
    p99 = worst["wait_p99_ms"] if worst else None
    who = worst["tenant"] if worst else "-"
    util = result["flood_window"]["utilisation_pct"]
    targets = [
        bench_targets.below(
            "quiet_p99_wait", p99, QUIET_P99_MS,
            f"quiet tenants' queue-wait p99 < {QUIET_P99_MS:.0f} ms under the flood: worst "
            f"{'never served' if p99 is None else f'{p99:.0f} ms'} ({who})"),
        bench_targets.at_least(
            "pool_utilisation", util, UTILISATION_MIN_PCT,
            f"pool >= {UTILISATION_MIN_PCT:.0f} % utilised during the flood: "
            f"{'-' if util is None else f'{util:.1f} %'} of the quota used"),
    ]
    result["targets"] = targets
    result["all_targets_pass"] = bench_targets.all_pass(targets)
    return result


# -- text -------------------------------------------------------------------------
def _num(v: Any, fmt: str = ".0f") -> str:
    return "never" if v is None else format(v, fmt)


def format_tenants(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [f"     {'tenant':<10} {'role':<8} {'requests':>9} {'wait p50 ms':>12} {'wait p99 ms':>12} "
           f"{'max ms':>8} {'tokens':>8} {'tokens/s':>9}"]
    for r in rows:
        requests = f"{r['completed']}/{r['sent']}"
        out.append(f"     {r['tenant']:<10} {r['role']:<8} {requests:>9} {_num(r['wait_p50_ms']):>12} "
                   f"{_num(r['wait_p99_ms']):>12} {_num(r['wait_max_ms']):>8} {r['tokens']:>8} "
                   f"{_num(r['tokens_per_s'], '.1f'):>9}")
    return out


def format_window(w: Mapping[str, Any], naive: Mapping[str, Any]) -> list[str]:
    naive_pct = naive.get("tpm_utilisation_pct")
    return [
        f"  upstream over the flood window ({w['window_s']:.1f} s, quota {w['quota_tokens']} tokens):",
        f"     used {w['used_tokens']} tokens = {_num(w['utilisation_pct'], '.1f')} % "
        f"(served {w['served_tokens']} + held-in-flight change {w['held_change_tokens']:+d} "
        f"- bucket drawdown {w['bucket_drawdown_tokens']:+d}); refill wasted at a full bucket "
        f"{w['wasted_tokens']} tokens ({_num(w['unwasted_pct'], '.1f')} % not wasted)",
        f"     naive: served/quota {_num(w['served_pct'], '.1f')} %; bench.load's whole-second "
        f"figure {'-' if naive_pct is None else f'{naive_pct:.1f} %'}",
    ]


def format_report(result: Mapping[str, Any]) -> str:
    c = result["config"]
    up = result["upstream"]
    lines = [
        f"gateway-dev bench-fairness: tier {c['tier']}, simulator {c['tpm']} TPM "
        f"({c['tpm'] / 60:.0f} tokens/s), burst {c['burst_s']:g} s, latency "
        f"{c['base_latency_ms']:g} ms + {c['ms_per_output_token']:g} ms/token; one worker, "
        f"{c['concurrency']} threads; Redis {c['redis']}",
        f"  flooder: {c['flood_requests']} requests at once; {c['quiet_tenants']} quiet tenants, one "
        f"request each every {c['quiet_interval_s']:g} s (~{c['quiet_share_pct']:.0f} % of the TPM)",
        f"  flood: {result['flood_window']['window_s']:.1f} s until the flooder's last request "
        f"was dispatched",
        *format_tenants(result["tenants"]),
        *format_window(result["flood_window"], result["flood_window_naive"]),
        f"  upstream over the run: {up['requests_ok']} ok, {up['requests_429']} x 429",
        "",
        *bench_targets.format_targets(result["targets"]),
        f"total bench time {result['runtime_s']:.0f} s",
    ]
    return "\n".join(lines)
