"""`gateway-dev bench`: the headline numbers of one run -- what the targets judge and
the README's table quotes -- read out of a policy's run (bench/load.py) and out
of the plain-Celery comparison (bench/plain.py).

A ``None`` here means unbounded: a VIP p99 of tasks never dispatched, a ratio
or a per-message figure with nothing in its denominator, a utilisation with no
whole second in its window.  bench/spread.py summarises several runs'
headlines; bench/report.py judges the targets on one.
"""

from __future__ import annotations

from typing import Any


def policy_headline(run: dict[str, Any]) -> dict[str, Any]:
    """VIP p99 wait (phase B), token shares, TPM used and round trips (phase A), 429s (run)."""
    vip = run["vip_arrivals"]["waits"]["vip"]
    a = run["all_backlogged"]
    up = run["upstream"]
    return {
        "vip_p99_wait_ms": vip["wait_p99_ms"],
        "vip_undispatched": vip["undispatched"],
        "share_pct": {tier: row["share_pct"] for tier, row in a["tiers"].items()},
        "tpm_utilisation_pct": a["tpm_utilisation_pct"],
        "requests_429": up["requests_429"],
        "rate_429_pct": up["rate_429_pct"],
        "round_trips_per_msg": a["dispatch"]["round_trips_per_msg"],
    }


def plain_headline(plain: dict[str, Any]) -> dict[str, Any]:
    """Overhead ratio and best tasks/s per transport; round trips of each one's last run."""
    last = {kind: runs[-1] for kind, runs in plain["runs"].items()}
    return {
        "overhead_x": plain["overhead_x"],
        "tasks_per_s": dict(plain["best_tasks_per_s"]),
        "dispatch_round_trips_per_msg": {k: r["dispatch_round_trips_per_msg"]
                                         for k, r in last.items()},
        "ack_round_trips_per_msg": {k: r["ack_round_trips_per_msg"] for k, r in last.items()},
    }
