"""The cron storm benchmark's pure measures (rates, bins, latency percentiles,
deferred, targets), its quota sizing and task-id derivation, and its arguments
(`gateway-dev cron-bench --storm`).  The storm itself runs in `make bench-beat`."""

from __future__ import annotations

import pytest

from beat.fire import run_key
from gateway_tasks.core.settings import Settings
from devtools.bench import storm
from devtools.cli import build_parser
from devtools.bench.storm_report import spec_from_args
from devtools.bench.storm_stats import (deferred, first_reached_s, latency_stats,
                                        level_changes, rate_429_pct, rate_stats, rebin,
                                        targets, vip_p99_ratio, window_series)
from gateway_tasks.producer.gateway import Gateway


@pytest.mark.parametrize("first,series,start,end,expected", [
    (100, [1, 2, 3, 4, 5], 101.2, 103.9, [2, 3, 4]),
    (100, [1, 2, 3], 98.0, 101.5, [0, 0, 1, 2]),        # before the series: zeros
    (100, [1, 2, 3], 102.0, 104.0, [3, 0, 0]),          # after it: zeros
])
def test_window_series(first, series, start, end, expected):
    assert window_series(first, series, start, end) == expected


@pytest.mark.parametrize("series,bin_s,expected", [
    ([1, 2, 3, 4, 5], 2, [3, 7]), ([1, 2], 5, [3]), ([], 5, []), ([4, 4, 4], 1, [4, 4, 4])])
def test_rebin(series, bin_s, expected):
    assert rebin(series, bin_s) == expected


@pytest.mark.parametrize("series,bin_s,peak,mean,ratio", [
    ([10, 10, 10, 10], 1, 10, 10, 1.0),
    ([40, 10, 10, 20], 1, 40, 20, 2.0),
    ([40, 10, 10, 20], 2, 25, 20, 1.25),
    ([0, 0], 1, 0.0, 0.0, None),
])
def test_rate_stats(series, bin_s, peak, mean, ratio):
    got = rate_stats(series, bin_s)
    assert (got["peak_per_s"], got["mean_per_s"], got["peak_over_mean"]) == (peak, mean, ratio)


def test_latency_stats_count_unfinished_tasks_as_infinite():
    assert latency_stats([100.0] * 99 + [900.0]) == {"count": 100, "missing": 0, "p50_ms": 100.0,
                                                      "p99_ms": 100.0, "max_ms": 900.0}
    got = latency_stats([100.0] * 98, missing=2)
    assert got["p50_ms"] == 100.0 and got["p99_ms"] is None and got["max_ms"] is None
    assert latency_stats([])["p99_ms"] is None


def test_deferred_429_rate_and_vip_ratio():
    assert deferred([0, 999, 1000, 5000]) == 2
    assert rate_429_pct(997, 3) == 0.3 and rate_429_pct(0, 0) == 0.0
    assert vip_p99_ratio(200.0, 300.0) == 1.5 and vip_p99_ratio(None, 1.0) is None


def test_level_changes_are_seconds_from_the_boundary():
    history = [{"ts_ms": 59_000, "from": 0, "to": 1, "reason": "warm-up"},
               {"ts_ms": 61_240, "from": 1, "to": 3, "reason": "tier vip waited"},
               {"ts_ms": "x", "from": 3, "to": 4},                     # malformed: left out
               {"from": 3, "to": 0},                                   # no time: left out
               {"ts_ms": 95_000, "from": 3, "to": 0, "reason": "calm"}]
    got = level_changes(history, boundary_ms=60_000)
    assert [(c["at_s"], c["from"], c["to"]) for c in got] == [(-1.0, 0, 1), (1.2, 1, 3), (35.0, 3, 0)]
    assert got[1]["reason"] == "tier vip waited"


@pytest.mark.parametrize("changes,level,expected", [
    ([], 3, None),
    ([{"at_s": 1.2, "to": 3}], 3, 1.2),
    ([{"at_s": -2.0, "to": 3}, {"at_s": 4.0, "to": 4}], 3, 4.0),   # before B does not count
    ([{"at_s": 0.5, "to": 1}, {"at_s": 9.8, "to": 3}], 3, 9.8),
    ([{"at_s": 0.5, "to": 2}], 3, None),
    ([{"at_s": 0.0, "to": 4}], 3, 0.0),                            # above the level counts
])
def test_first_reached_s(changes, level, expected):
    assert first_reached_s(changes, level) == expected


def test_targets_are_judged_on_jitter_on():
    run = {"upstream": {"rate": {"peak_over_mean": 1.2}, "rate_429_pct": 0.31},
           "vip_probe": {"quiet": {"p99_ms": 200.0}, "storm": {"p99_ms": 280.0}, "p99_ratio": 1.4}}
    got = {t["target"]: t["ok"] for t in targets(run)}
    assert got == {"peak_over_mean": True, "rate_429_pct": False, "vip_p99_ratio": True}


def test_quota_fits_the_jittered_storm_plus_the_probe():
    spec = storm.StormSpec(tenants=100, compress=20, quota_fill=1.0, probe_rate=2.0)
    tpm, rpm = storm.quota(spec, Settings())
    runs = 3 * len(spec.tenants_of())
    assert runs == 300 and [t for _, t in spec.tenants_of()].count("batch") == 60
    probe = storm._charged(storm.probe_prompt(100), storm.PROBE_MAX_TOKENS)
    assert tpm == pytest.approx((runs * storm.tokens_per_run(spec) / 30 + 2 * probe) * 60, abs=1)
    assert rpm == pytest.approx((runs / 30 + 2) * 60 * 1.5, abs=1)
    half = storm.quota(storm.StormSpec(tenants=100, quota_fill=0.5), Settings())
    assert half[0] == pytest.approx(2 * tpm, abs=2)


def test_storm_settings_compress_or_zero_the_windows(settings):
    pool = settings.pools[0]
    on = storm.storm_settings(settings, storm.StormSpec(compress=20), storm.StormMode("on", True), "p:", pool)
    off = storm.storm_settings(settings, storm.StormSpec(compress=20), storm.StormMode("off", False), "p:", pool)
    assert [t.jitter_window_s for t in on.tiers] == [0, 6, 30]
    assert [t.jitter_window_s for t in off.tiers] == [0, 0, 0]
    assert on.key_prefix == "p:" and on.pools == (pool,)
    assert [t.scheduled_lag_tokens for t in on.tiers] == [8192] * 3          # the settings' own


def test_storm_lanes_can_be_set_or_compared(settings):
    pool = settings.pools[0]
    spec = storm.StormSpec(scheduled_lag_tokens=100)
    Mode = storm.StormMode

    def of(run: storm.StormMode):
        return storm.storm_settings(settings, spec, run, "p:", pool)
    assert [t.scheduled_lag_tokens for t in of(Mode("on", True)).tiers] == [100] * 3
    assert [t.scheduled_lag_tokens for t in of(Mode("on", True, lag=0)).tiers] == [0] * 3
    assert storm.storm_modes(storm.StormSpec()) == [Mode("jitter_off", False), Mode("jitter_on", True)]
    assert storm.storm_modes(storm.StormSpec(compare_lanes=True))[-1] == Mode("jitter_on_no_lanes", True, lag=0)
    assert storm.storm_modes(storm.StormSpec(compare_slots=True))[-1] == Mode("jitter_on_no_kept_slots", True,
                                                                              kept_slots=0)
    assert storm.storm_modes(storm.StormSpec(compare_layout=True))[-1] == Mode("jitter_on_tiered", True, tiered=True)
    assert storm.storm_modes(storm.StormSpec(compare_switch_ms=0.5))[-1] == Mode("jitter_on_switch", True,
                                                                                 switch_interval_ms=0.5)
    assert len(storm.storm_modes(storm.StormSpec(compare_slots=True, compare_switch_ms=1.0))) == 4
    assert storm.storm_modes(storm.StormSpec(compare_sim_stack=True))[-1] == Mode("jitter_on_python_sim", True,
                                                                                  sim_stack="python")
    plain = of(Mode("on", True))
    assert (plain.reserved_worker_slots, plain.worker_switch_interval_ms, plain.worker_gc_freeze) == (1, 5.0, True)
    assert of(Mode("on", True, kept_slots=0)).reserved_worker_slots == 0
    assert of(Mode("on", True, switch_interval_ms=0.5)).worker_switch_interval_ms == 0.5
    assert of(Mode("on", True, gc_freeze=False)).worker_gc_freeze is False
    assert storm.storm_modes(storm.StormSpec(compare_gc_freeze=True))[-1] == Mode("jitter_on_no_gc_freeze", True,
                                                                                  gc_freeze=False)
    assert plain.overload.backlog_signal is True
    blind = of(Mode("on", True, backlog_signal=False))
    assert blind.overload.backlog_signal is False and blind.overload.window_s == plain.overload.window_s
    assert storm.storm_modes(storm.StormSpec(compare_backlog=True))[-1] == Mode("jitter_on_no_backlog", True,
                                                                                backlog_signal=False)


@pytest.mark.parametrize("total,expected", [
    (32, {"vip": 8, "normal": 12, "batch": 12}),
    (33, {"vip": 8, "normal": 12, "batch": 13}),
    (4, {"vip": 1, "normal": 1, "batch": 2}),
    (3, {"vip": 1, "normal": 1, "batch": 1}),
])
def test_tier_worker_slots_split_the_same_threads(total, expected):
    got = storm.tier_worker_slots(total)
    assert got == expected and sum(got.values()) == total


def fake_mode(mode: str, lag: int) -> dict:
    lat = {"count": 1, "missing": 0, "p50_ms": 100.0, "p99_ms": 200.0, "max_ms": 200.0}
    tier = {"runs": 1, "completed": 1, "e2e": lat, "from_scheduled": lat, "queue_wait_p99_ms": 1.0,
            "deferred": 0, "fire_lag_p99_ms": 1.0, "jitter_window_s": 6}
    rate = {"bin_s": 1, "peak_per_s": 10.0, "mean_per_s": 9.0, "peak_over_mean": 1.1}
    return {"mode": mode, "runs": 3, "completed": 3, "storm_s": 30.0, "quota": {"tpm": 1, "rpm": 1, "burst_s": 1},
            "scheduled_lag_tokens": {"vip": lag}, "load_avg": [2.5, 2.0, 1.5],
            "upstream": {"rate": rate, "rate_5s": rate, "requests_429": 0, "rate_429_pct": 0.0, "series": [1, 2]},
            "requeued_after_429": 0, "deferred": 0, "tiers": {t: tier for t in ("vip", "normal", "batch")},
            "vip_probe": {"quiet": lat, "storm": {**lat, "queue_wait_p99_ms": 5.0, "upstream_p99_ms": 170.0}, "p99_ratio": 1.0}}


def test_the_report_shows_every_mode_side_by_side():
    from devtools.bench.storm_report import format_storm_report

    modes = {m: fake_mode(m, 0 if "no_lanes" in m else 8192)
             for m in ("jitter_off", "jitter_on", "jitter_on_no_lanes")}
    text = format_storm_report({"spec": {"tenants": 1, "compress": 20, "workers": 2, "concurrency": 16,
                                         "beats": 2}, "modes": modes, "targets": targets(modes["jitter_on"])})
    assert "on, no lanes" in text and "scheduled lane lag vip 8192 tokens" in text
    assert "load average (1 min) at the end" in text and text.count("2.50") == 3
    assert "VIP probe upstream call p99 before / during, ms" in text and "-/170" in text
    assert "load level L3 reached, s after B" in text


def test_the_report_lists_each_mode_s_level_changes():
    from devtools.bench.storm_report import format_storm_report

    modes = {m: fake_mode(m, 8192) for m in ("jitter_off", "jitter_on")}
    modes["jitter_on"].update(levels=[{"at_s": 1.2, "from": 0, "to": 3, "reason": "tier vip waited 2.1 s"}],
                              l3_at_s=1.2)
    text = format_storm_report({"spec": {"tenants": 1, "compress": 20, "workers": 2, "concurrency": 16,
                                         "beats": 2}, "modes": modes, "targets": targets(modes["jitter_on"])})
    assert "load level, jitter_on: +1.2 s L0 -> L3 (tier vip waited 2.1 s)" in text
    assert "load level, jitter_off" not in text


def test_task_id_of_a_run_is_the_one_beat_submits_with(r, settings):
    gw = Gateway(settings)
    try:
        gw.register_tenant("t1", "batch")
        h = gw.submit("t1", "hello", source="cron", idempotency_key=run_key("t1:digest-0", 1234, "s3cr3t"))
        assert storm.task_id_of("t1", "t1:digest-0", 1234, "s3cr3t") == h.id
    finally:
        gw.app.close()


def test_cron_bench_takes_the_storm_flags():
    parser = build_parser()
    args = parser.parse_args(["cron-bench", "--storm", "--tenants", "50", "--compress", "10"])
    assert args.storm and args.tenants == 50 and args.compress == 10 and args.quota_fill == 1.0
    assert args.scheduled_lag_tokens is None and not args.compare_lanes
    args = parser.parse_args(["cron-bench", "--storm", "--scheduled-lag-tokens", "0", "--compare-lanes"])
    assert args.scheduled_lag_tokens == 0 and args.compare_lanes
    assert parser.parse_args(["cron-bench", "--storm", "--compare-slots"]).compare_slots
    assert parser.parse_args(["cron-bench", "--storm", "--compare-layout"]).compare_layout
    assert not parser.parse_args(["cron-bench"]).storm
    spec = spec_from_args(parser.parse_args(["cron-bench", "--storm", "--compare-gc-freeze", "--compare-sim-stack",
                                             "--compare-switch", "0.5", "--sim-stack", "python"]))
    assert (spec.compare_gc_freeze, spec.compare_sim_stack, spec.compare_switch_ms, spec.sim_stack) == \
        (True, True, 0.5, "python")
    assert spec_from_args(parser.parse_args(["cron-bench", "--storm", "--compare-backlog"])).compare_backlog
    assert not (spec.compare_lanes or spec.compare_slots or spec.compare_layout)
    assert [m.name for m in storm.storm_modes(spec)] == ["jitter_off", "jitter_on", "jitter_on_switch",
                                                         "jitter_on_python_sim", "jitter_on_no_gc_freeze"]
    assert spec_from_args(parser.parse_args(["cron-bench", "--storm"])) == storm.StormSpec()
    with pytest.raises(SystemExit):
        parser.parse_args(["cron-bench", "--storm", "--sim-stack", "twisted"])


def test_backlog_watch_keeps_the_peak_and_when():
    watch = storm.BacklogWatch(boundary_s=100.0)
    assert watch.to_json() == {"peak_s": 0.0, "peak_at_s": None}
    for signals, now_s in [({}, 99.5), ({"backlog_s": {"default": 4.25}}, 101.0),
                           ({"backlog_s": {"default": 9.81, "other": 1.0}}, 103.4),
                           ({"backlog_s": {"default": 2.0}}, 105.0), ({"backlog_s": None}, 106.0)]:
        watch.see(signals, now_s)
    assert watch.to_json() == {"peak_s": 9.8, "peak_at_s": 3.4}
