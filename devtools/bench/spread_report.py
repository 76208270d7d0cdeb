"""`gateway-dev bench --runs N`: the text of a combined result (bench/spread.py).

Per policy and for the plain-Celery comparison, each headline number as
``median (min–max)`` over the runs; then the checks and the targets, judged on
the medians, with how many of the runs passed each.  Every run's own tables are
in ``--json`` (``runs``).
"""

from __future__ import annotations

from typing import Any

from devtools.bench.report import format_checks, format_header, format_targets, took

LABEL_WIDTH = 38


def spread_text(s: dict[str, Any], digits: int = 0, unbounded: str = "-") -> str:
    """``median (min–max)``; an unbounded value (None) shows as ``unbounded``."""
    median, low, high = (unbounded if v is None else f"{v:.{digits}f}"
                         for v in (s["median"], s["min"], s["max"]))
    return f"{median} ({low}–{high})"


def _row(label: str, value: str) -> str:
    return f"     {label:<{LABEL_WIDTH}} {value}"


def format_policy_spread(policy: str, tree: dict[str, Any]) -> list[str]:
    shares = tree["share_pct"]
    return [
        f"== policy {policy}: median (min–max) over {tree['vip_p99_wait_ms']['runs']} runs",
        _row("VIP p99 queue wait ms (B)",
             spread_text(tree["vip_p99_wait_ms"], 0, "never")),
        _row("VIP tasks never dispatched (B)", spread_text(tree["vip_undispatched"])),
        _row(f"token shares % {':'.join(shares)} (A)",
             " : ".join(spread_text(s, 1) for s in shares.values())),
        _row("upstream TPM used % (A)", spread_text(tree["tpm_utilisation_pct"], 1)),
        _row("429s over the run: count, %",
             f"{spread_text(tree['requests_429'])}, {spread_text(tree['rate_429_pct'], 3)}"),
        _row("dispatch round trips per message (A)",
             spread_text(tree["round_trips_per_msg"], 2, "unbounded")),
    ]


def format_plain_spread(tree: dict[str, Any], plain: dict[str, Any]) -> list[str]:
    """``plain``: one run's comparison, for what was compared."""
    runs = tree["overhead_x"]["runs"]
    out = [f"== plain Celery vs the gateway transport: median (min–max) over {runs} runs of "
           f"{plain['tasks']} x {plain['task']}, one worker, {plain['concurrency']} "
           f"{plain['pool']}; alternating plain/gateway pairs per run: {plain['repeats']} "
           "(ratio of the best)",
           _row("gateway time / plain time (x)", spread_text(tree["overhead_x"], 2, "unbounded"))]
    for kind in ("plain", "gateway"):
        out.append(_row(f"{kind} tasks/s", spread_text(tree["tasks_per_s"][kind], 1)))
    for kind in ("plain", "gateway"):
        out.append(_row(f"{kind} round trips/msg: dispatch, ack",
                        f"{spread_text(tree['dispatch_round_trips_per_msg'][kind], 2)}, "
                        f"{spread_text(tree['ack_round_trips_per_msg'][kind], 2)}"))
    return out


def format_report(result: dict[str, Any]) -> str:
    runs = result["config"]["runs"]
    lines = format_header(result, f"; {runs} runs")
    lines += [f"== {runs} runs (each: every policy on fresh key prefixes, then the plain "
              "comparison), " + ", ".join(f"{r['runtime_s']:.0f}" for r in result["runs"]) + " s",
              "     A = all tiers backlogged, B = vip arriving under the batch flood", ""]
    for policy, tree in result["spread"]["policies"].items():
        lines += format_policy_spread(policy, tree) + [""]
    if result["spread"].get("plain_celery"):
        lines += format_plain_spread(result["spread"]["plain_celery"],
                                     result["runs"][0]["plain_celery"]) + [""]
    lines += format_checks(result["checks"], result["judged_policy"], runs)
    lines += format_targets(result["targets"], runs)
    lines.append(took(result))
    return "\n".join(lines)
