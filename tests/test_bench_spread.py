"""`gateway-dev bench --runs N` without running anything: the spread maths (median,
min, max; runs passing) and the multi-run report, on fake evaluated runs."""

from __future__ import annotations

import argparse
import json

import pytest

from gateway_tasks.core.errors import ConfigError
from devtools.bench import load as bench_load
from devtools.bench import main as bench
from devtools.bench import report as bench_report
from devtools.bench import spread as bench_spread
from devtools.bench import spread_report
from devtools.bench.headline import plain_headline, policy_headline
from devtools.measure import spread

TIERS = [{"name": "vip", "share": 70, "reserved_share": 0.2, "max_wait_ms": 2000},
         {"name": "normal", "share": 20, "reserved_share": 0.0, "max_wait_ms": 30000},
         {"name": "batch", "share": 10, "reserved_share": 0.0, "max_wait_ms": 300000}]


def fake_policy_run(policy, *, p99_ms=4.0, undispatched=0, shares=(70.0, 20.0, 10.0),
                    tpm_pct=99.0, n429=0, round_trips=1.1, runtime_s=70.0):
    """One policy's run as bench/load.py returns it, with the headline numbers given."""
    tiers = {t: {"dispatched": 10, "completed": 10, "est_tokens": 100, "actual_tokens": 100,
                 "share_pct": s, "share_est_pct": s}
             for t, s in zip(("vip", "normal", "batch"), shares)}
    dispatch = {"picks": 10, "waits": 1, "dispatched": 10, "round_trips_per_msg": round_trips}
    waits = {t: {"tasks": 40, "undispatched": 0, "wait_p50_ms": 1.0, "wait_p99_ms": 9.0,
                 "wait_max_ms": 9.0, "censored": False} for t in ("normal", "batch")}
    waits["vip"] = {"tasks": 80 - undispatched, "undispatched": undispatched, "wait_p50_ms": 1.0,
                    "wait_p99_ms": p99_ms, "wait_max_ms": 50.0, "censored": p99_ms is None,
                    "sent": 80}
    phase = {"window_s": 20.0, "tiers": tiers, "dispatch": dispatch, "seconds": 20,
             "served_tokens": 198_000, "served_tokens_per_s": 9900.0, "tpm_utilisation_pct": tpm_pct}
    return {
        "policy": policy, "prefix": f"gt-bench-{policy}-0:", "worker_ready_s": 1.0,
        "enqueued": {"batch": 5000, "normal": 1400, "vip": 3500},
        "all_backlogged": phase,
        "vip_arrivals": {**phase, "vip_rate_per_s": 20.0, "waits": waits},
        "upstream": {"requests_ok": 10_000, "requests_429": n429, "requests_error": 0,
                     "rate_429_pct": round(100.0 * n429 / (10_000 + n429), 4),
                     "gateway_saw_429": n429},
        "runtime_s": runtime_s,
    }


def fake_plain(plain_tps=381.0, gateway_tps=407.0):
    """The plain-Celery comparison as bench/plain.py returns it (one pair)."""
    def one(tps, dispatch_rt):
        return {"tasks": 3000, "elapsed_s": 3000 / tps, "tasks_per_s": tps, "prefix": "p:",
                "completed": 3000, "dispatch_round_trips_per_msg": dispatch_rt,
                "ack_round_trips_per_msg": 1.0, "counted": {}}
    return {"task": "gateway.noop", "tasks": 3000, "repeats": 1, "concurrency": 32,
            "pool": "threads", "order": ["plain", "gateway"],
            "runs": {"plain": [one(plain_tps, 2.0)], "gateway": [one(gateway_tps, 1.1)]},
            "best_tasks_per_s": {"plain": plain_tps, "gateway": gateway_tps},
            "mean_tasks_per_s": {"plain": plain_tps, "gateway": gateway_tps},
            "overhead_x": round(plain_tps / gateway_tps, 3)}


def fake_result(policy_runs, plain=None, runtime_s=300.0):
    """One evaluated bench run, as run_bench returns it."""
    result = {"config": {"redis": "redis://127.0.0.1:6379/0",
                         "policies": [r["policy"] for r in policy_runs],
                         "load": bench_load.spec_dict(bench_load.LoadSpec()), "tiers": TIERS,
                         "plain_tasks": 3000, "repeats": 1, "log_dir": "/tmp/bench"},
              "policies": {r["policy"]: r for r in policy_runs}, "runtime_s": runtime_s}
    if plain:
        result["plain_celery"] = plain
    return bench_report.evaluate(result)


def three_runs():
    """fifo never serves VIP; wfq's VIP p99 is 4, 40 and 60 ms (the last run fails it)."""
    return [fake_result([fake_policy_run("fifo", p99_ms=None, undispatched=70, shares=(0, 0, 100)),
                         fake_policy_run("wfq", p99_ms=p99, n429=n429, tpm_pct=tpm,
                                         shares=(70.0 + d, 20.0 - d, 10.0))],
                        fake_plain(plain_tps, 400.0), runtime_s=300.0 + i)
            for i, (p99, n429, tpm, d, plain_tps) in enumerate(
                ((4.0, 0, 99.4, 0.2, 380.0), (40.0, 2, 99.1, -0.4, 360.0),
                 (60.0, 0, 98.0, 0.1, 540.0)))]


# -- the maths ----------------------------------------------------------------------
def test_spread_is_median_min_max_of_the_runs():
    assert spread([3, 1, 2]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": 3}
    assert spread([4.0, 40.0]) == {"median": 22.0, "min": 4.0, "max": 40.0, "runs": 2}
    assert spread([5]) == {"median": 5.0, "min": 5.0, "max": 5.0, "runs": 1}
    assert spread([70.15, 70.1])["median"] == 70.125          # no float noise
    with pytest.raises(ValueError):
        spread([])


def test_spread_counts_none_as_unbounded():
    # a p99 of VIP tasks never dispatched is above every measured one
    assert spread([4.0, None, 60.0]) == {"median": 60.0, "min": 4.0, "max": None, "runs": 3}
    assert spread([None, None, 4.0]) == {"median": None, "min": 4.0, "max": None, "runs": 3}
    assert spread([4.0, None])["median"] is None
    json.dumps(spread([None, None]), allow_nan=False)        # JSON without Infinity


def test_spread_tree_and_medians_keep_the_headline_shape():
    trees = [{"x": 1, "share_pct": {"vip": 70.0, "batch": 30.0}},
             {"x": 3, "share_pct": {"vip": 72.0, "batch": 28.0}},
             {"x": 2, "share_pct": {"vip": 68.0, "batch": 32.0}}]
    tree = bench_spread.spread_tree(trees)
    assert tree["x"] == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": 3}
    assert tree["share_pct"]["vip"] == {"median": 70.0, "min": 68.0, "max": 72.0, "runs": 3}
    assert bench_spread.medians(tree) == {"x": 2.0, "share_pct": {"vip": 70.0, "batch": 30.0}}


def test_headlines_are_what_the_targets_judge():
    run = fake_policy_run("wfq", p99_ms=12.0, n429=3, tpm_pct=97.5, round_trips=1.3)
    assert policy_headline(run) == {
        "vip_p99_wait_ms": 12.0, "vip_undispatched": 0,
        "share_pct": {"vip": 70.0, "normal": 20.0, "batch": 10.0},
        "tpm_utilisation_pct": 97.5, "requests_429": 3, "rate_429_pct": 0.03,
        "round_trips_per_msg": 1.3}
    assert plain_headline(fake_plain(381.0, 407.0)) == {
        "overhead_x": 0.936, "tasks_per_s": {"plain": 381.0, "gateway": 407.0},
        "dispatch_round_trips_per_msg": {"plain": 2.0, "gateway": 1.1},
        "ack_round_trips_per_msg": {"plain": 1.0, "gateway": 1.0}}


def test_runs_passing_counts_each_target_and_check():
    results = three_runs()
    assert bench_spread.runs_passing_target(results, "vip_p99_wait") == 2
    assert bench_spread.runs_passing_target(results, "overhead_vs_plain_celery") == 2
    assert bench_spread.runs_passing_target(results, "token_shares") == 3
    assert bench_spread.runs_passing_check(results, "fifo", "vip_p99_wait") == 0
    assert bench_spread.runs_passing_check(results, "fifo", "tpm_and_429") == 3


def test_combine_judges_the_targets_on_the_medians():
    results = three_runs()
    combined = bench_spread.combine(results)
    assert combined["config"]["runs"] == 3 and combined["runs"] == results
    assert combined["runtime_s"] == 903.0
    wfq = combined["spread"]["policies"]["wfq"]
    assert wfq["vip_p99_wait_ms"] == {"median": 40.0, "min": 4.0, "max": 60.0, "runs": 3}
    assert wfq["share_pct"]["vip"] == {"median": 70.1, "min": 69.6, "max": 70.2, "runs": 3}
    assert wfq["requests_429"] == {"median": 0.0, "min": 0.0, "max": 2.0, "runs": 3}
    assert wfq["tpm_utilisation_pct"]["median"] == 99.1
    assert combined["spread"]["policies"]["fifo"]["vip_p99_wait_ms"]["median"] is None
    plain = combined["spread"]["plain_celery"]
    assert plain["overhead_x"] == {"median": 0.95, "min": 0.9, "max": 1.35, "runs": 3}
    assert plain["tasks_per_s"]["gateway"]["median"] == 400.0

    targets = {t["target"]: t for t in combined["targets"]}
    assert list(targets) == ["vip_p99_wait", "token_shares", "tpm_and_429",
                             "overhead_vs_plain_celery"]
    assert combined["judged_policy"] == "wfq"
    vip = targets["vip_p99_wait"]
    assert vip["ok"] and vip["value_ms"] == 40.0 and vip["runs_passed"] == 2
    assert targets["overhead_vs_plain_celery"]["value_x"] == 0.95
    assert targets["overhead_vs_plain_celery"]["runs_passed"] == 2
    assert all(t["ok"] for t in targets.values()) and combined["all_targets_pass"]
    assert combined["checks"]["fifo"]["vip_p99_wait"] == {
        "ok": False, "value_ms": None, "limit_ms": 50.0, "undispatched": 70.0, "runs_passed": 0}
    json.dumps(combined, allow_nan=False)


def test_a_median_that_misses_fails_even_when_one_run_passed():
    results = [fake_result([fake_policy_run("wfq", p99_ms=p99)]) for p99 in (4.0, 55.0, 90.0)]
    combined = bench_spread.combine(results)
    (vip,) = [t for t in combined["targets"] if t["target"] == "vip_p99_wait"]
    assert not vip["ok"] and vip["value_ms"] == 55.0 and vip["runs_passed"] == 1
    assert not combined["all_targets_pass"] and "plain_celery" not in combined["spread"]


# -- the text -----------------------------------------------------------------------
def test_spread_text():
    assert spread_report.spread_text({"median": 4.0, "min": 3.2, "max": 40.0}) == "4 (3–40)"
    assert spread_report.spread_text({"median": 0.94, "min": 0.9, "max": 1.25}, 2) == \
        "0.94 (0.90–1.25)"
    assert spread_report.spread_text({"median": None, "min": 4.0, "max": None}, 0, "never") == \
        "never (4–never)"


def test_multi_run_report_prints_every_headline_as_median_min_max():
    combined = bench_spread.combine(three_runs())
    combined["elapsed_s"] = 912.3
    text = bench.format_result(combined)
    lines = text.splitlines()
    assert "3 runs" in lines[0] and "301, 302" in text
    assert "== policy wfq: median (min–max) over 3 runs" in text
    assert any("VIP p99 queue wait ms" in l and l.endswith("40 (4–60)") for l in lines)
    assert any("VIP p99 queue wait ms" in l and l.endswith("never (never–never)") for l in lines)
    assert "70.1 (69.6–70.2) : 19.9 (19.8–20.4) : 10.0 (10.0–10.0)" in text
    assert any(l.strip().startswith("upstream TPM used %") and "99.1 (98.0–99.4)" in l
               for l in lines)
    assert "0 (0–2), 0.000 (0.000–0.020)" in text
    assert any(l.strip().startswith("dispatch round trips per message") and "1.10 (1.10–1.10)" in l
               for l in lines)
    assert "gateway time / plain time (x)" in text and "0.95 (0.90–1.35)" in text
    assert any(l.strip().startswith("gateway tasks/s") and "400.0 (400.0–400.0)" in l
               for l in lines)
    assert "1.10 (1.10–1.10), 1.00 (1.00–1.00)" in text              # gateway round trips
    assert "== targets (judged on the medians of 3 runs)" in text
    judged = [l.strip() for l in lines if l.strip().startswith(("PASS", "FAIL"))]
    assert len(judged) == 4 and all(l.startswith("PASS") for l in judged)
    assert judged[0].endswith("40 ms [wfq]; 2 of 3 runs pass")
    assert judged[3].endswith("0.95x; 2 of 3 runs pass")
    assert any(l.split() == ["fifo", "FAIL", "0/3", "FAIL", "0/3", "PASS", "3/3"] for l in lines)
    assert lines[-1] == "bench took 912 s"


def test_one_run_report_is_the_single_run_text():
    (one, *_) = three_runs()
    text = bench.format_result(one)
    assert text == bench_report.format_report(one)
    assert "median" not in text and "runs pass" not in text
    assert "== policy wfq  (backlog: 5000 batch" in text and text.endswith("bench took 300 s")


def test_repeated_runs_once_per_run_and_combines():
    results = three_runs()
    calls, said = iter(results), []
    combined = bench.repeated(3, lambda: next(calls), said.append)
    assert combined["runs"] == results and said == ["== run 1 of 3", "== run 2 of 3", "== run 3 of 3"]
    said.clear()
    assert bench.repeated(1, lambda: results[0], said.append) is results[0] and said == []


def test_runs_flag():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).runs == 1
    assert parser.parse_args(["--runs", "3", "--policies", "wfq"]).runs == 3
    args = parser.parse_args(["--runs", "0", "--quick"])
    with pytest.raises(ConfigError, match="--runs"):
        bench.run(args)                                 # before any Redis or process starts
