"""The router-v2 benches (`gateway-dev bench-fairness`, `gateway-dev bench-dispatch`): their
pure parts -- utilisation accounting, stat aggregation, targets, formatting --
and one small smoke run of the server-side pick measurement.  No timing asserts."""

from __future__ import annotations

import argparse
import json

import pytest
import redis

from devtools.cli import build_parser
from devtools.bench import (command_purpose, dispatch, dispatch_cpu, dispatch_rate,
                            dispatch_report, dispatch_server, fairness,
                            fairness_report, targets)
from devtools.bench.redis_stats import Cost, stats_delta
from devtools.bench.utilisation import UpstreamPoint, window_utilisation
from gateway_tasks.local.redis_server import EmbeddedRedis, redis_server_binary
from gateway_tasks.simulator import SimConfig, Simulator
from gateway_tasks.simulator.bucket import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- utilisation -------------------------------------------------------------------
def test_bucket_counts_refill_lost_at_capacity():
    clock = Clock()
    bucket = TokenBucket(100, 10, clock)
    clock.now += 3.0                       # full all along: 30 units of refill lost
    assert bucket.level == 100 and bucket.wasted == pytest.approx(30)
    bucket.take(50)
    clock.now += 2.0                       # 20 of the 50 come back: nothing lost
    assert bucket.level == pytest.approx(70) and bucket.wasted == pytest.approx(30)
    bucket.give(40)                        # only 30 fit
    assert bucket.level == 100 and bucket.wasted == pytest.approx(40)
    bucket.fill()
    assert bucket.wasted == 0


def point(sim: Simulator, clock: Clock) -> UpstreamPoint:
    """What the simulator's /stats says at ``clock.now`` (the fields UpstreamPoint reads)."""
    return UpstreamPoint.from_stats({
        "now_monotonic": clock.now, "tokens_prompt": sim.stats.tokens_prompt,
        "tokens_completion": sim.stats.tokens_completion, "tokens_level": sim.tokens.level,
        "tokens_held": sim.held_tokens, "tokens_wasted": sim.tokens.wasted})


def test_the_simulators_accounting_balances_over_any_window():
    clock = Clock()
    sim = Simulator(SimConfig(tpm=60_000, burst_s=2.0, models=("m",)), clock=clock)  # 1000/s
    start = point(sim, clock)                 # a full bucket: 2000 tokens of burst
    for _ in range(12):                       # admit 150 + completion 60 of 100 max, 0.1 s each
        assert sim.admit(50, 100).ok
        clock.now += 0.1
        sim.complete(50, 100, 60)
        sim.stats.record_ok("m", 50, 60)
    assert sim.admit(50, 100).ok              # one left in flight at the end
    clock.now += 0.05
    end = point(sim, clock)
    w = window_utilisation(start, end, 1000.0)
    assert w["window_s"] == pytest.approx(1.25)
    assert w["served_tokens"] == 12 * 110
    assert w["held_change_tokens"] == 150
    # the identity: quota used = quota - refill lost, whatever the bucket held at either end
    assert w["used_tokens"] == pytest.approx(w["quota_tokens"] - w["wasted_tokens"], abs=1)
    assert w["utilisation_pct"] == pytest.approx(w["unwasted_pct"], abs=0.1)
    # the naive figure counts the burst spent inside the window
    assert w["bucket_drawdown_tokens"] == 220 and w["wasted_tokens"] == 0
    assert w["utilisation_pct"] == 100.0 and w["served_pct"] == 105.6


def test_window_utilisation_of_a_bucket_that_refilled_inside_the_window():
    start = UpstreamPoint(0.0, served_tokens=0, level_tokens=0.0, held_tokens=0, wasted_tokens=0.0)
    end = UpstreamPoint(10.0, served_tokens=8000, level_tokens=2000.0, held_tokens=0,
                        wasted_tokens=0.0)
    w = window_utilisation(start, end, 1000.0)
    # 80 % served; the other 2000 tokens are banked in the bucket, not lost
    assert w["served_pct"] == 80.0 and w["bucket_drawdown_tokens"] == -2000
    assert w["utilisation_pct"] == 100.0 == w["unwasted_pct"]


# -- targets -------------------------------------------------------------------------
def test_target_helpers_and_text():
    ts = [targets.below("a", 5.0, 10.0, "a < 10"), targets.at_least("b", None, 1.0, "b >= 1"),
          targets.at_most("c", 1.3, 1.3, "c <= 1.3")]
    assert [t["ok"] for t in ts] == [True, False, True]
    assert not targets.all_pass(ts) and targets.all_pass([ts[0]]) and not targets.all_pass([])
    assert targets.format_targets(ts) == ["== targets", "  PASS  a < 10", "  FAIL  b >= 1",
                                          "  PASS  c <= 1.3"]
    assert targets.status(None) == "n/a"


# -- bench-fairness ------------------------------------------------------------------
def result_of(wait_ms: float, tokens: int = 300) -> dict:
    return {"timing": {"queue_wait_ms": wait_ms}, "tokens": {"total": tokens}}


def fairness_result(quiet_waits: list[list[float]], util: float | None, sent_extra: int = 0) -> dict:
    rows = [fairness_report.tenant_row("flood-0", fairness_report.FLOODER, 3,
                                       [result_of(w, 230) for w in (10, 2000, 4000)], 10.0)]
    for k, waits in enumerate(quiet_waits):
        rows.append(fairness_report.tenant_row(f"quiet-{k + 1}", fairness_report.QUIET,
                                               len(waits) + sent_extra,
                                               [result_of(w) for w in waits], 10.0))
    window = {"window_s": 10.0, "quota_tokens": 20000, "served_tokens": 20500,
              "bucket_drawdown_tokens": 900, "held_change_tokens": 100, "used_tokens": 19700,
              "wasted_tokens": 300, "served_pct": 102.5, "utilisation_pct": util,
              "unwasted_pct": 98.5}
    config = {**json.loads(json.dumps(fairness.FairnessSpec().__dict__)), "redis": "x",
              "quiet_share_pct": 30.0}
    return fairness_report.evaluate({"config": config, "tenants": rows, "flood_window": window,
                                     "flood_window_naive": {"tpm_utilisation_pct": 104.0},
                                     "upstream": {"requests_ok": 10, "requests_429": 0,
                                                  "requests_error": 0}, "runtime_s": 70.0})


def test_tenant_row_aggregates_waits_and_tokens():
    row = fairness_report.tenant_row("q", "quiet", 4, [result_of(w) for w in (100, 300, 200)], 6.0)
    assert row["sent"] == 4 and row["completed"] == 3 and row["tokens"] == 900
    assert row["tokens_per_s"] == 150.0
    assert row["wait_p50_ms"] == 200 and row["wait_max_ms"] == 300
    assert row["undispatched"] == 1 and row["wait_p99_ms"] is None   # one never answered


def test_fairness_targets_pass_and_fail():
    good = fairness_result([[100, 150], [90, 800]], 97.0)
    assert good["all_targets_pass"]
    assert [t["target"] for t in good["targets"]] == ["quiet_p99_wait", "pool_utilisation"]
    assert "worst 800 ms (quiet-2)" in good["targets"][0]["text"]

    slow = fairness_result([[100, 1500]], 97.0)
    assert [t["ok"] for t in slow["targets"]] == [False, True]
    lost = fairness_result([[100]], 97.0, sent_extra=1)   # a quiet request never answered
    assert not lost["targets"][0]["ok"] and "never served" in lost["targets"][0]["text"]
    idle = fairness_result([[100]], 90.0)
    assert [t["ok"] for t in idle["targets"]] == [True, False]


def test_fairness_report_text():
    text = fairness_report.format_report(fairness_result([[100, 150]], 97.0))
    assert "flood-0" in text and "quiet-1" in text and "never" not in text.split("==")[0]
    assert "97.0 %" in text and "naive: served/quota 102.5 %" in text and "104.0 %" in text
    assert sum(line.strip().startswith(("PASS", "FAIL")) for line in text.splitlines()) == 2


def test_fairness_spec_is_about_a_third_quiet_and_a_minute_of_flood():
    spec = fairness.FairnessSpec()
    quiet_tokens = 32 + fairness.QUIET_LOAD.completion_tokens
    assert 25 <= spec.quiet_share_pct(quiet_tokens) <= 35
    flood_tokens = 32 + fairness.FLOODER_LOAD.completion_tokens
    left_per_s = spec.tokens_per_s * (1 - spec.quiet_share_pct(quiet_tokens) / 100)
    assert 50 <= spec.flood_requests * flood_tokens / left_per_s <= 90


# -- bench-dispatch ------------------------------------------------------------------
SHAS = {"a" * 40: "pick", "b" * 40: "release"}


def entry(command: str, usec: int, client: str = "127.0.0.1:5000") -> dict:
    return {"command": command.encode(), "duration": usec, "client_address": client.encode()}


def test_command_purposes():
    p = command_purpose.purpose
    assert p(["EVALSHA", "a" * 40, "16"], SHAS) == "evalsha pick"
    assert p(["EVALSHA", "c" * 40], SHAS) == "evalsha ?"
    assert p(["PUBLISH", "p:/0.celeryev/task.started", "x"], SHAS) == "publish: task events"
    assert p(["SETEX", "p:celery-task-meta-1", "86400", "x"], SHAS) == "setex: result backend"
    assert p(["BLPOP", "p:{p:default}:bell", "1"], SHAS) == "blpop: bell"
    assert p(["BRPOP", "p:bench.plain", "1"], SHAS) == "brpop: queue"
    assert p(["ZADD", "p:unacked_index", "1", "t"], SHAS) == "zadd: kombu unacked"
    assert p(["SET", "p:task-owner:1", "acme"], SHAS) == "set: task owner"
    assert p(["MULTI"], SHAS) == "multi/exec" and p(["PING"], SHAS) == "ping" and p([""], SHAS) == "?"


def test_evalsha_split_by_script_is_calibrated_to_the_clean_run():
    entries = [entry("HGET k f", 2, "?:0"), entry("HSET k f v", 3, "?:0"),
               entry(f"EVALSHA {'a' * 40} 1 k", 30),              # pick: ran 2 commands
               entry("GET x", 1),
               entry("HDEL k f", 1, "?:0"), entry(f"EVALSHA {'b' * 40} 1 k", 12)]  # release: 1
    by = command_purpose.evalsha_by_script(entries, SHAS)
    assert by == {"pick": {"calls": 1, "usec": 30, "ran": 2},
                  "release": {"calls": 1, "usec": 12, "ran": 1}}
    costs, per_logged = command_purpose.calibrated(by, clean_usec=33)
    assert per_logged == pytest.approx(3.0)
    assert costs == {"pick": Cost(1, 24), "release": Cost(1, 9)}
    assert sum(c.usec for c in costs.values()) == 33
    top = command_purpose.breakdown([e for e in entries if e["client_address"] != b"?:0"], SHAS)
    assert top["get"] == Cost(1, 1) and top["evalsha pick"] == Cost(1, 30)


def test_costs_and_deltas():
    before = {"get": Cost(10, 50), "set": Cost(1, 5)}
    after = {"get": Cost(30, 90), "set": Cost(1, 5), "rpop": Cost(4, 10)}
    assert stats_delta(before, after) == {"get": Cost(20, 40), "rpop": Cost(4, 10)}
    assert Cost(4, 10).us_per_call == 2.5 and Cost().us_per_call is None


def test_rate_of_concurrent_runs():
    out = dispatch_rate.rate_of([(1000, 10.0, 11.0), (1000, 10.2, 12.0)], redis_cpu_s=0.5)
    assert out["operations"] == 2000 and out["wall_s"] == 2.0 and out["per_s"] == 1000
    assert out["redis_busy_pct"] == 25.0 and out["redis_cpu_us_per_op"] == 250.0
    assert out["redis_ceiling_per_s"] == 4000
    assert dispatch_rate.rate_of([], 0.0)["per_s"] is None


def test_per_task_and_cpu_rows():
    rows = dispatch_cpu.per_task({"a": Cost(100, 500), "b": Cost(300, 3000)}, 100)
    assert list(rows) == ["b", "a"] and rows["b"] == {"calls_per_task": 3.0, "us_per_task": 30.0}
    row = dispatch_cpu.cpu_of("plain", 200, 200, 199, 0.1, {"evalsha": Cost(400, 8000)}, reads=2_300)
    assert row["redis_cpu_us_per_task"] == 500.0 and row["evalsha_per_task"] == 2.0
    assert row["round_trips_per_task"] == 11.5
    assert row["evalsha_usec"] == 8000 and row["succeeded"] == 199


def dispatch_result(pick_us: float, per_s: int, infer_us: float) -> dict:
    pick = [{"scenario": f"s{k}", "prompt_b": 600, "message_b": 2000, "tenants": 10, "queued": 5,
             "us_per_enqueue": 20.0, "picks": 5, "dispatched": 5, "us_per_pick": v,
             "acks": 5, "us_per_ack": 10.0} for k, v in enumerate((pick_us - 1, pick_us))]
    rate = {"processes": 8, "operations": 100, "wall_s": 1.0, "per_s": per_s,
            "redis_cpu_s": 0.01, "redis_busy_pct": 1.0, "redis_cpu_us_per_op": 100.0,
            "redis_ceiling_per_s": 10000}
    flows = [{"flow": f, "prompt_b": b, "redis_cpu_us_per_task": us, "evalsha_per_task": 0.0,
              "succeeded": 5}
             for b in (600, 8192) for f, us in (("plain", 500.0), ("gateway_noop", 600.0),
                                                ("gateway_infer", infer_us))]
    flows[2]["breakdown"] = {"commands": {"evalsha pick": {"calls_per_task": 1.0, "us_per_task": 90.0}},
                             "command_us_per_task": 90.0, "slowlog_us_per_logged_command": 1.0}
    return dispatch_report.evaluate({
        "config": {"redis_version": "7.0", "cores": 2},
        "server": {"picks_per_scenario": 5, "pick": pick,
                   "plain_list": [{"prompt_b": 600, "message_b": 2000, "us_per_lpush": 1.0,
                                   "rpops": 5, "popped": 5, "us_per_rpop": 2.0}],
                   "pick_anatomy": {"picks": 5, "logged_us_per_pick": 40.0, "ran_us_per_pick": 12.0,
                                    "commands_per_pick": 25.0,
                                    "ran": {"zadd": {"calls_per_pick": 2.0, "us_per_pick": 4.0}}},
                   "pick_floor": {"commands": 15, "names": ["time"], "keys": 13, "args": 42,
                                  "replay_us": 20.5, "empty_with_pick_args_us": 4.0},
                   "warmup_picks": 1000},
        "rate": {"prompt_b": 600, "messages": 100, "tenants": 10, "gateway": rate,
                 "plain_rpop": dict(rate, per_s=50000)},
        "cpu": {"tasks": 5, "flows": flows}, "runtime_s": 9.0})


def test_dispatch_targets():
    good = dispatch_result(29.0, 16000, 600.0)
    assert [t["target"] for t in good["targets"]] == ["pick_us", "dispatches_per_s", "cpu_per_task_x"]
    assert good["all_targets_pass"]
    assert dispatch_report.cpu_ratios(good["cpu"]["flows"], "gateway_infer") == {600: 1.2, 8192: 1.2}
    bad = dispatch_result(31.0, 14000, 700.0)
    assert [t["ok"] for t in bad["targets"]] == [False, False, False]
    assert "worst 31.0 us (s1)" in bad["targets"][0]["text"]
    assert "1.40x at 600 B" in bad["targets"][2]["text"]


def test_dispatch_report_text():
    text = dispatch_report.format_report(dispatch_result(25.0, 16000, 600.0))
    for part in ("== 1.", "== 2.", "== 3.", "a pick runs 25 commands", "the rest of its 24.0 us, 12.0 us",
                 "floor: those 15 commands replayed by a script with no logic take 20.5 us a call",
                 "13 keys and 42 arguments 4.0 us: 24.5 us before", "1000 picks on a fresh queue first",
                 "gateway_infer: commands 90 us", "evalsha pick 90"):
        assert part in text, part
    assert sum(line.strip().startswith(("PASS", "FAIL")) for line in text.splitlines()) == 3


def test_scenarios_and_prompts():
    names = [s.name for s in dispatch_server.scenarios(100, 10_000)]
    assert names == ["600 B prompts, 10 tenants", "8 KB prompts, 10 tenants",
                     "600 B prompts, 10000 tenants", "8 KB prompts, 10000 tenants"]
    assert [s.messages for s in dispatch_server.scenarios(100, 10_000)] == [100, 100, 10_000, 10_000]
    assert len(dispatch_server.prompt_of(8192).encode()) == 8192


def test_replay_script_of_logged_commands():
    raw = [[2, 0, 5, [b"HSET", b"k", b"f", b"v"], b"?:0", b""],              # newest first, as Redis
           [1, 0, 3, [b"EVALSHA", b"abc", b"0"], b"127.0.0.1:5000", b""],   # a client's: left out
           [0, 0, 4, [b"ZRANGEBYLEX", b"i", b"[t|", b"[t|\xff"], b"?:0", b""]]
    commands = dispatch_server.script_commands(raw)
    assert commands == [[b"ZRANGEBYLEX", b"i", b"[t|", b"[t|\xff"], [b"HSET", b"k", b"f", b"v"]]
    assert dispatch_server.lua_literal(b'a"b\\c\xff') == '"a\\34b\\92c\\255"'
    script = dispatch_server.replay_script(commands)
    assert script.startswith('local C = {{"ZRANGEBYLEX","i","[t|","[t|\\255"},{"HSET","k","f","v"}}')
    assert "redis.call(unpack(C[i]))" in script


def test_cli_knows_the_new_benches():
    parser = build_parser()
    args = parser.parse_args(["bench-dispatch", "--quick", "--parts", "server,rate", "--picks", "7"])
    assert args.func is dispatch.run and dispatch.parse_parts(args.parts) == ["server", "rate"]
    assert dispatch.sizes_from_args(args) == {**dispatch.QUICK, "picks": 7}
    args = parser.parse_args(["bench-fairness", "--quick", "--json"])
    assert args.func is fairness.run and args.json
    assert fairness.spec_from_args(args).flood_requests == fairness.QUICK["flood_requests"]
    with pytest.raises(Exception):
        dispatch.parse_parts("server,nope")
    with pytest.raises(Exception):
        fairness.spec_from_args(argparse.Namespace(flood=0, quick=False, tpm=1, concurrency=1))


# -- a tiny real run ---------------------------------------------------------------
@pytest.mark.slow
def test_server_side_pick_measurement_at_tiny_size(settings):
    with EmbeddedRedis(binary=redis_server_binary()) as server:
        client = redis.Redis.from_url(server.url)
        try:
            out = dispatch_server.run(client, settings.with_(redis_url=server.url), picks=60,
                                      many_tenants=120, warmup_picks=20)
        finally:
            client.close()
        out = json.loads(json.dumps(out))
        assert out["picks_per_scenario"] == 60 and len(out["pick"]) == 4
        for row in out["pick"]:
            assert row["picks"] == 60 and row["dispatched"] == 60 and row["acks"] == 60
            assert row["us_per_pick"] > 0 and row["us_per_ack"] > 0 and row["us_per_enqueue"] > 0
            assert row["message_b"] > row["prompt_b"]
        assert [r["queued"] for r in out["pick"]] == [60, 60, 120, 120]
        assert [r["popped"] for r in out["plain_list"]] == [60, 60]
        anatomy = out["pick_anatomy"]
        assert anatomy["picks"] == 50 and anatomy["commands_per_pick"] > 5
        assert 0 < anatomy["ran_us_per_pick"] < anatomy["logged_us_per_pick"]
        assert {"zrangebylex", "hget"} <= set(anatomy["ran"])
        floor = out["pick_floor"]                     # the pick's own commands, replayed
        assert floor["names"][0] == "time" and {"hincrby", "zrem"} <= set(floor["names"])
        assert floor["commands"] == len(floor["names"]) > 5 and floor["keys"] > 5 and floor["args"] > 10
        assert floor["replay_us"] > 0 and floor["empty_with_pick_args_us"] > 0
        assert out["warmup_picks"] == 20
        # every run's keys are gone
        assert not list(redis.Redis.from_url(server.url).scan_iter(match="gt-bench-*", count=1000))
