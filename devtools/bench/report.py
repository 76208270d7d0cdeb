"""`gateway-dev bench`, part 4: judging the targets and printing the result.

The issue's targets are judged on one policy -- ``wfq``, the default, when it
was run (else the first policy run); every other policy gets the same checks
in a matrix, for comparison:

* VIP p99 queue wait < 50 ms while VIP arrives within its reservation (phase B);
* token shares within +-3 points of the tiers' shares, 70:20:10 (phase A,
  tokens the upstream reported);
* >= 95 % of the upstream TPM used (phase A) with <= 0.1 % of requests 429
  (whole run);
* the gateway transport's time for the no-op tasks <= 1.3 x plain Celery's.
"""

from __future__ import annotations

from typing import Any

from devtools.bench.headline import plain_headline, policy_headline
from devtools.bench.wall_time import took_line

VIP_P99_MS = 50.0
SHARE_POINTS = 3.0
TPM_MIN_PCT = 95.0
RATE_429_MAX_PCT = 0.1
OVERHEAD_MAX_X = 1.3
TARGET_POLICY = "wfq"


def target_shares(tiers: list[dict[str, Any]]) -> dict[str, float]:
    total = sum(t["share"] for t in tiers) or 1.0
    return {t["name"]: 100.0 * t["share"] / total for t in tiers}


def _status(ok: bool | None) -> str:
    return "PASS" if ok else ("FAIL" if ok is not None else "n/a")


def policy_checks(headline: dict[str, Any], shares: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The three scheduling checks on one policy's headline numbers (bench/headline.py)."""
    p99, undispatched = headline["vip_p99_wait_ms"], headline["vip_undispatched"]
    got = headline["share_pct"]
    worst = max(abs(got.get(t, 0.0) - s) for t, s in shares.items())
    util, rate = headline["tpm_utilisation_pct"], headline["rate_429_pct"]
    return {
        "vip_p99_wait": {
            "ok": p99 is not None and p99 < VIP_P99_MS and undispatched == 0,
            "value_ms": p99, "limit_ms": VIP_P99_MS, "undispatched": undispatched},
        "token_shares": {
            "ok": worst <= SHARE_POINTS, "shares_pct": got,
            "target_pct": {t: round(s, 2) for t, s in shares.items()},
            "worst_deviation_points": round(worst, 2), "limit_points": SHARE_POINTS},
        "tpm_and_429": {
            "ok": util is not None and util >= TPM_MIN_PCT and rate is not None
                  and rate <= RATE_429_MAX_PCT,
            "tpm_utilisation_pct": util, "min_pct": TPM_MIN_PCT,
            "rate_429_pct": rate, "max_429_pct": RATE_429_MAX_PCT},
    }


def overhead_target(headline: dict[str, Any]) -> dict[str, Any]:
    """The transport-overhead target on the plain-Celery comparison's headline numbers."""
    x = headline["overhead_x"]
    return {"target": "overhead_vs_plain_celery", "policy": None,
            "ok": x is not None and x <= OVERHEAD_MAX_X, "value_x": x, "limit_x": OVERHEAD_MAX_X}


def judged_policy(policies: list[str]) -> str | None:
    return TARGET_POLICY if TARGET_POLICY in policies else (policies[0] if policies else None)


def add_targets(result: dict[str, Any], checks: dict[str, dict[str, Any]],
                plain: dict[str, Any] | None) -> dict[str, Any]:
    """Sets judged_policy, targets and all_targets_pass from per-policy checks and the
    plain comparison's headline (None when it was not run)."""
    judged = judged_policy(list(checks))
    targets: list[dict[str, Any]] = []
    if judged:
        for name in ("vip_p99_wait", "token_shares", "tpm_and_429"):
            targets.append({"target": name, "policy": judged, **checks[judged][name]})
    if plain:
        targets.append(overhead_target(plain))
    result["judged_policy"] = judged
    result["targets"] = targets
    result["all_targets_pass"] = bool(targets) and all(t["ok"] for t in targets)
    return result


def evaluate(result: dict[str, Any]) -> dict[str, Any]:
    """Adds ``checks`` to every policy and the final ``targets`` to one run's result."""
    shares = target_shares(result["config"]["tiers"])
    for run in result["policies"].values():
        run["checks"] = policy_checks(policy_headline(run), shares)
    plain = result.get("plain_celery")
    return add_targets(result, {name: run["checks"] for name, run in result["policies"].items()},
                       plain_headline(plain) if plain else None)


# -- text -------------------------------------------------------------------------
def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.0f}"


def _wait(row: dict[str, Any], key: str) -> str:
    if row.get(key) is not None:
        return f"{row[key]:.0f}"
    if row.get("undispatched"):
        return "never"
    return "-"


def format_policy(run: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    a, b, up = run["all_backlogged"], run["vip_arrivals"], run["upstream"]
    enq = run["enqueued"]
    out = [f"== policy {run['policy']}  (backlog: {enq['batch']} batch, then {enq['normal']} normal "
           f"and {enq['vip']} vip; run took {run['runtime_s']:.0f} s)"]
    out.append(f"  A. all tiers backlogged, {a['window_s']:.1f} s window")
    out.append(f"     {'tier':<7} {'dispatched':>10} {'tokens':>9} {'share %':>8} "
               f"{'(est %)':>8} {'target %':>9}")
    targets = run.get("checks", {}).get("token_shares", {}).get("target_pct", {})
    for tier, row in a["tiers"].items():
        out.append(f"     {tier:<7} {row['dispatched']:>10} {row['actual_tokens']:>9} "
                   f"{row['share_pct']:>8.1f} {row['share_est_pct']:>8.1f} "
                   f"{targets.get(tier, 0.0):>9.0f}")
    util = a["tpm_utilisation_pct"]
    out.append(f"     upstream TPM used: {'-' if util is None else f'{util:.1f} %'} of the quota "
               f"(the simulator's accounting; tokens served {a['served_tokens_per_s'] or 0:.0f} of "
               f"{spec['tpm'] / 60:.0f} /s = {a.get('served_pct') or 0:.1f} %, bucket drawdown "
               f"{a.get('bucket_drawdown_tokens', 0)} tokens)")
    d = a["dispatch"]
    out.append(f"     dispatch: {d['round_trips_per_msg'] or 0:.2f} Redis round trips per message "
               f"({d['picks']} picks + {d['waits']} bell waits for {d['dispatched']} messages)")
    out.append(f"  B. vip arriving at {b['vip_rate_per_s']:.1f}/s under the batch flood, "
               f"{b['window_s']:.1f} s window")
    out.append(f"     {'tier':<7} {'tasks':>6} {'wait p50 ms':>12} {'wait p99 ms':>12} "
               f"{'max ms':>9} {'share %':>8}")
    for tier, w in b["waits"].items():
        tasks = f"{w['tasks']}" + (f"+{w['undispatched']}?" if w.get("undispatched") else "")
        out.append(f"     {tier:<7} {tasks:>6} {_wait(w, 'wait_p50_ms'):>12} "
                   f"{_wait(w, 'wait_p99_ms'):>12} {_ms(w['wait_max_ms']):>9} "
                   f"{b['tiers'][tier]['share_pct']:>8.1f}")
    vip = b["waits"]["vip"]
    if vip.get("undispatched"):
        out.append(f"     ({vip['undispatched']} of {vip['sent']} vip tasks were still queued "
                   f"{spec['grace_s']:g} s after the window: their wait is 'never')")
    util_b = b["tpm_utilisation_pct"]
    d = b["dispatch"]
    out.append(f"     upstream TPM used: {'-' if util_b is None else f'{util_b:.1f} %'}; dispatch: "
               f"{d['round_trips_per_msg'] or 0:.2f} round trips per message")
    out.append(f"  upstream over the run: {up['requests_ok']} ok, {up['requests_429']} x 429 "
               f"({up['rate_429_pct']:.3f} %), gateway saw {up['gateway_saw_429']} x 429")
    return out


def format_plain(plain: dict[str, Any]) -> list[str]:
    out = [f"== plain Celery vs the gateway transport: {plain['tasks']} x {plain['task']} "
           f"pre-enqueued, one worker, {plain['concurrency']} {plain['pool']}, alternating runs"]
    out.append(f"     {'run':<4} {'plain tasks/s':>14} {'gateway tasks/s':>16}")
    runs = plain["runs"]
    for i in range(max(len(runs["plain"]), len(runs["gateway"]))):
        p = runs["plain"][i]["tasks_per_s"] if i < len(runs["plain"]) else None
        g = runs["gateway"][i]["tasks_per_s"] if i < len(runs["gateway"]) else None
        out.append(f"     {i + 1:<4} {p if p is not None else '-':>14} {g if g is not None else '-':>16}")
    x = plain.get("overhead_x")
    out.append(f"     gateway time / plain time (best runs): {'-' if x is None else f'{x:.2f}x'}"
               f"  (means: {plain['mean_tasks_per_s']['plain']} vs "
               f"{plain['mean_tasks_per_s']['gateway']} tasks/s)")
    rp, rg = runs["plain"][-1], runs["gateway"][-1]
    out.append(f"     Redis round trips per message: plain {rp['dispatch_round_trips_per_msg']:.2f} "
               f"dispatch (BRPOP + unacked-record pipeline) + {rp['ack_round_trips_per_msg']:.2f} ack; "
               f"gateway {rg['dispatch_round_trips_per_msg']:.2f} dispatch (pick.lua + bell waits) "
               f"+ {rg['ack_round_trips_per_msg']:.2f} ack")
    return out


def format_target(t: dict[str, Any]) -> str:
    name = t["target"]
    if name == "vip_p99_wait":
        v = "never dispatched" if t["value_ms"] is None else f"{t['value_ms']:.0f} ms"
        text = f"VIP p99 queue wait < {t['limit_ms']:.0f} ms within its reservation: {v}"
    elif name == "token_shares":
        got = ":".join(f"{v:.1f}" for v in t["shares_pct"].values())
        want = ":".join(f"{v:.0f}" for v in t["target_pct"].values())
        text = (f"token shares within +-{t['limit_points']:.0f} points of {want}: {got} "
                f"(worst {t['worst_deviation_points']:.1f} points)")
    elif name == "tpm_and_429":
        util = t["tpm_utilisation_pct"]
        text = (f">= {t['min_pct']:.0f} % TPM used with <= {t['max_429_pct']} % 429: "
                f"{'-' if util is None else f'{util:.1f} %'} used, {t['rate_429_pct']:.3f} % 429")
    else:
        x = t["value_x"]
        text = (f"overhead <= {t['limit_x']}x plain Celery: "
                f"{'-' if x is None else f'{x:.2f}x'}")
    where = f" [{t['policy']}]" if t.get("policy") else ""
    return f"{_status(t['ok'])}  {text}{where}"


def format_header(result: dict[str, Any], runs_note: str = "") -> list[str]:
    spec = result["config"]["load"]
    return [f"gateway-dev bench: upstream simulator {spec['tpm']} TPM / {spec['rpm']} RPM, burst "
            f"{spec['burst_s']:g} s, latency {spec['base_latency_ms']:g} ms + "
            f"{spec['ms_per_output_token']:g} ms/token; one worker, {spec['concurrency']} "
            f"{spec['pool']}; Redis {result['config']['redis']}{runs_note}", ""]


def _cell(check: dict[str, Any], runs: int | None) -> str:
    return _status(check["ok"]) + (f" {check['runs_passed']}/{runs}" if runs else "")


def format_checks(checks: dict[str, dict[str, Any]], judged: str | None,
                  runs: int | None = None) -> list[str]:
    """The checks-per-policy matrix (only when several policies ran); with ``runs``, the
    checks are on the medians and each cell also says how many runs passed it."""
    if len(checks) < 2:
        return []
    width = 8 if runs is None else 10
    out = [f"== checks per policy (the targets below are judged on {judged})",
           f"     {'policy':<8} {'vip p99':>{width}} {'shares':>{width}} {'tpm+429':>{width}}"]
    for name, c in checks.items():
        out.append(f"     {name:<8} " + " ".join(f"{_cell(c[k], runs):>{width}}" for k in
                                                   ("vip_p99_wait", "token_shares", "tpm_and_429")))
    return out + [""]


def format_targets(targets: list[dict[str, Any]], runs: int | None = None) -> list[str]:
    """PASS/FAIL per target; with ``runs``, judged on the medians, and how many runs passed."""
    if runs is None:
        return ["== targets"] + ["  " + format_target(t) for t in targets]
    return ([f"== targets (judged on the medians of {runs} runs)"]
            + [f"  {format_target(t)}; {t['runs_passed']} of {runs} runs pass" for t in targets])


def took(result: dict[str, Any]) -> str:
    """The last line: the whole command's wall time (else, outside the CLI, the runs')."""
    return took_line(result.get("elapsed_s", result.get("runtime_s", 0.0)))


def format_report(result: dict[str, Any]) -> str:
    spec = result["config"]["load"]
    lines = format_header(result)
    for run in result["policies"].values():
        lines += format_policy(run, spec) + [""]
    if result.get("plain_celery"):
        lines += format_plain(result["plain_celery"]) + [""]
    lines += format_checks({name: run["checks"] for name, run in result["policies"].items()},
                           result["judged_policy"])
    lines += format_targets(result["targets"])
    lines.append(took(result))
    return "\n".join(lines)
