"""`gateway-dev bench` at a tiny size: the JSON document's structure and sane values
(real Redis, simulator, worker processes).  No timing assertions."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from devtools.bench import main as bench

from devtools.bench import load as bench_load

from devtools.bench import report as bench_report
from devtools.measure import percentile

pytestmark = pytest.mark.slow


def test_tiny_bench_json_structure(settings, r, tmp_path):
    spec = bench_load.LoadSpec(batch=150, seconds=2.0, warmup_s=1.0, settle_s=0.5, grace_s=1.0,
                               vip_rate=10.0, concurrency=8)
    result = bench.run_bench(settings, settings.redis_url, spec, ["wfq"], plain_tasks=150,
                             repeats=1, log_dir=str(tmp_path))
    result = json.loads(json.dumps(result))          # it is one JSON document

    assert set(result) >= {"config", "policies", "plain_celery", "targets", "judged_policy",
                           "all_targets_pass", "runtime_s"}
    assert result["judged_policy"] == "wfq" and list(result["policies"]) == ["wfq"]
    run = result["policies"]["wfq"]
    assert run["enqueued"]["batch"] == 150

    a = run["all_backlogged"]
    assert set(a["tiers"]) == {"vip", "normal", "batch"}
    assert sum(t["dispatched"] for t in a["tiers"].values()) > 0
    assert math.isclose(sum(t["share_pct"] for t in a["tiers"].values()), 100.0, abs_tol=0.1)
    assert math.isclose(sum(t["share_est_pct"] for t in a["tiers"].values()), 100.0, abs_tol=0.1)
    # below 1 when a dispatcher with free slots takes several tasks in one pick
    assert a["dispatch"]["dispatched"] > 0 and a["dispatch"]["round_trips_per_msg"] > 0
    assert a["served_tokens"] > 0 and a["tpm_utilisation_pct"] > 0

    b = run["vip_arrivals"]
    vip = b["waits"]["vip"]
    assert vip["sent"] > 0 and vip["tasks"] + vip["undispatched"] == vip["sent"]
    if vip["tasks"]:
        assert 0 <= vip["wait_p50_ms"] <= vip["wait_max_ms"]
    up = run["upstream"]
    assert up["requests_ok"] > 0 and 0.0 <= up["rate_429_pct"] <= 100.0

    plain = result["plain_celery"]
    for kind in ("plain", "gateway"):
        (only,) = plain["runs"][kind]
        assert only["completed"] == 150 and only["tasks_per_s"] > 0
        assert only["dispatch_round_trips_per_msg"] > 0   # below 1: several tasks a pick
    assert plain["overhead_x"] > 0

    names = [t["target"] for t in result["targets"]]
    assert names == ["vip_p99_wait", "token_shares", "tpm_and_429", "overhead_vs_plain_celery"]
    assert all(isinstance(t["ok"], bool) for t in result["targets"])
    text = bench_report.format_report(result)
    assert "policy wfq" in text and "plain Celery" in text
    assert sum(line.strip().startswith(("PASS", "FAIL")) for line in text.splitlines()) == 4
    assert text.splitlines()[-1] == f"bench took {result['runtime_s']:.0f} s"

    # every run's keys are gone
    prefixes = [run["prefix"], plain["runs"]["plain"][0]["prefix"], plain["runs"]["gateway"][0]["prefix"]]
    for prefix in prefixes:
        assert prefix.startswith("gt-bench-") and not list(r.scan_iter(match=f"{prefix}*", count=1000))


def test_cli_flags_and_quick_preset():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    bench.register(sub)
    args = parser.parse_args(["bench", "--quick", "--policies", "wfq,fifo", "--json"])
    assert args.func is bench.run and args.json
    assert bench.parse_policies(args.policies) == ["wfq", "fifo"]
    spec = bench.load_spec(args)
    assert spec.batch == bench.QUICK["batch"] and spec.seconds == bench.QUICK["seconds"]
    args = parser.parse_args(["bench", "--batch", "5000", "--seconds", "20"])
    spec = bench.load_spec(args)
    assert spec.batch == 5000 and spec.seconds == 20
    with pytest.raises(Exception, match="policies"):
        bench.parse_policies("wfq,lottery")


def test_helpers():
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(1, 101)), 99) == 99
    w = bench_load.wait_stats([1.0, 2.0, 3.0], missing=1)
    assert w["undispatched"] == 1 and w["wait_p99_ms"] is None and w["censored"]
    series = {"served_per_s": {"first_second": 100, "tokens": [5, 10, 10, 10, 7]}}
    got = bench_load.served_in_window(series, 100.5, 103.9, tokens_per_s=10.0)
    assert got == {"seconds": 2, "served_tokens": 20, "served_tokens_per_s": 10.0,
                   "tpm_utilisation_pct": 100.0}


def test_shown_redis_url_has_no_credentials():
    from gateway_tasks.core.urls import without_credentials
    from devtools.run_redis import shown_redis

    assert shown_redis("redis://user:s3cret@db.example:6380/2", embedded=False) == \
        "redis://db.example:6380/2"
    assert shown_redis("rediss://:s3cret@db.example/0?password=s3cret&ssl_cert_reqs=none",
                       embedded=False) == "rediss://db.example/0?ssl_cert_reqs=none"
    assert shown_redis("redis://127.0.0.1:6399/0", embedded=True) == \
        "embedded redis-server at redis://127.0.0.1:6399/0 (REDIS_URL unset)"
    assert without_credentials("http://127.0.0.1:8099/v1") == "http://127.0.0.1:8099/v1"
