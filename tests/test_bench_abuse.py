"""bench-abuse's report maths on fixed inputs (the run itself: `gateway-dev bench-abuse`), and
its command line."""

from __future__ import annotations

from devtools.bench import abuse
from devtools.cli import build_parser


def run_row(deferred: int, p50_during: float, level: int) -> dict:
    victim = {"before": {"n": 10, "p50_ms": 50.0, "p99_ms": 90.0},
              "during": {"n": 20, "p50_ms": p50_during, "p99_ms": p50_during * 2},
              "deferred": deferred, "refused": {}}
    return {"victims": {t: dict(victim) for t, _ in abuse.VICTIMS}, "max_level": level, "level_changes": [],
            "whale_held_level": 3, "redis_memory_growth_mb": 12.0,
            "flooder": {"tasks": {"202": 500}, "crons": {"201": 20}, "huge_prompts": {"413 PromptTooLarge": 3},
                        "vip_tasks_completed_during": 50}}


def test_spread_and_the_deferral_target():
    config = {**abuse.AbuseSpec().__dict__, "redis": "test"}
    good = abuse.evaluate({"config": config, "runs": [run_row(0, 100.0, 0), run_row(0, 140.0, 0),
                                                      run_row(0, 120.0, 1)], "runtime_s": 1})
    v = good["spread"]["victims"]["victim-batch"]
    assert v["during_p50_ms"] == {"median": 120.0, "min": 100.0, "max": 140.0, "runs": 3}
    assert good["all_targets_pass"] and good["targets"]["victims_deferred"]["value"] == 0
    text = abuse.format_report(good)
    assert "victim-batch" in text and "120 (100-140)" in text and "PASS" in text
    bad = abuse.evaluate({"config": config, "runs": [run_row(2, 100.0, 3)], "runtime_s": 1})
    assert not bad["all_targets_pass"] and bad["targets"]["victims_deferred"]["value"] == 6
    assert "FAIL" in abuse.format_report(bad)


def test_the_command_and_its_presets():
    args = build_parser().parse_args(["bench-abuse", "--quick", "--runs", "4"])
    spec = abuse.spec_from_args(args)
    assert spec.runs == 4 and spec.during_s == abuse.QUICK["during_s"]
