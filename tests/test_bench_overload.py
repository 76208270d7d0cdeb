"""bench-overload's report maths on fixed inputs (the run itself is `make bench`), and the
environment its children (every bench's and devtools' child) are started with: the bench's
settings, whatever GATEWAY_*/REDIS_* variables the bench itself was started with."""

from __future__ import annotations

import argparse
import json

import pytest

from devtools import processes
from devtools.bench import overload, overload_report as rep
from devtools.bench.plain import plain_worker
from gateway_tasks.core.settings import SETTINGS_ENV_VARS, load_settings, settings_to_json


@pytest.mark.parametrize("values, q, expected", [
    ([], 99, None), ([5], 99, 5.0), (list(range(1, 101)), 99, 99.0), (list(range(1, 101)), 50, 50.0),
    ([3, 1, 2], 100, 3.0),
])
def test_percentile_table(values, q, expected):
    assert rep.percentile(values, q) == expected


def meta(wait_ms, changed=False, capped=False, fallback=False, status="SUCCESS"):
    if status != "SUCCESS":
        return {"status": status, "result": {"exc_type": "UpstreamError"}}
    return {"status": "SUCCESS", "result": {"timing": {"queue_wait_ms": wait_ms}, "overload": {
        "changed": changed, "max_tokens": {"capped": capped}, "model": {"substituted": fallback}}}}


def test_tier_row_counts_every_outcome():
    metas = [meta(10), meta(30, True, True, True), meta(0, status="FAILURE")]
    held = rep.deferral_row(2, [meta(10)])                   # 2 held: 1 later run, 1 never ended
    assert held == {"deferred": 2, "later_run": 1, "failed": 0, "lost": 1}
    row = rep.tier_row("batch", 4, {"L3 capacity_pressure: held up to 300 s": 2}, [300.0], {"QueueFull": 1},
                       metas, deferral=held)
    assert row["offered"] == 5 and row["completed"] == 2 and row["failed"] == 1 and row["pending"] == 1
    assert row["deferred"] == 2 and row["degraded"] == 1 and row["capped"] == 1 and row["fallback_model"] == 1
    assert row["failed_by"] == {"UpstreamError": 1} and row["p99_wait_ms"] == 30.0
    assert row["deferral"]["lost"] == 1


def result(changes, drop_s=60.0, **kw):
    return _result([{"from": 0, "reason": "test", **c} for c in changes], drop_s, **kw)


def _result(changes, drop_s=60.0, vip_done=1000, vip_p99=20.0, r429=0, pending=0):
    vip = {"tier": "vip", "offered": 1000, "completed": vip_done, "pending": pending, "p99_wait_ms": vip_p99,
           "deferred": 0, "deferred_retry_after_s": []}
    return {"config": {"hold_s": 30.0}, "tiers": {"vip": vip},
            "upstream": {"requests_ok": 1000, "requests_429": r429, "requests_error": 0},
            "drop_s": drop_s, "level_changes": changes}


@pytest.mark.parametrize("changes, expected", [
    ([], 0.0),
    ([{"t_s": 5, "to": 3}], None),                                   # never came back
    ([{"t_s": 5, "to": 3}, {"t_s": 80, "to": 1}, {"t_s": 100, "to": 0}], 40.0),
    ([{"t_s": 5, "to": 2}, {"t_s": 30, "to": 0}], 0.0),               # back before the drop
])
def test_return_to_l0(changes, expected):
    assert rep.return_to_l0_s(result(changes)) == expected


def test_targets_pass_and_fail():
    good = rep.evaluate(result([{"t_s": 5, "to": 3}, {"t_s": 110, "to": 0}]))
    assert good["all_targets_pass"], good["targets"]
    bad = rep.evaluate(result([{"t_s": 5, "to": 3}, {"t_s": 130, "to": 0}], vip_done=998, vip_p99=80.0,
                              r429=5, pending=1))
    assert {k for k, t in bad["targets"].items() if not t["pass"]} == {
        "vip_served", "vip_p99_wait", "upstream_429", "back_to_l0", "none_lost"}
    text = rep.format_report({**bad, "runtime_s": 1, "tiers": {"vip": {
        **bad["tiers"]["vip"], "submitted": 1, "failed": 0, "failed_by": {}, "deferred_by": {}, "refused": {},
        "degraded": 0, "capped": 0, "fallback_model": 0, "p50_wait_ms": 1.0}},
        "config": {**bad["config"], "overload_factor": 3, "overload_s": 60, "recovery_factor": 0.5,
                   "recovery_s": 75, "tpm": 1, "window_s": 10}, "timeline": [[0, 0], [5, 3]], "end_s": 135})
    assert "FAIL" in text and "  vip            0         0      0     0" in text


def test_compact_timeline_one_mark_per_step():
    assert rep.compact_timeline([(0, 0), (1, 1), (5.2, 3), (9, 3), (10.1, 0)]) == "030"


def test_quick_and_flags():
    ns = argparse.Namespace(tpm=1000, concurrency=4, quick=True, overload_s=None, recovery_s=None)
    spec = overload.spec_from_args(ns)
    assert spec.overload_s == overload.QUICK["overload_s"] and spec.tpm == 1000
    with pytest.raises(Exception, match="positive"):
        overload.spec_from_args(argparse.Namespace(tpm=0, concurrency=4, quick=False, overload_s=None,
                                                   recovery_s=None))
    assert abs(sum(m.share for m in overload.MIX) - 1.0) < 1e-9


# a value for every settings variable, as a shell that exported them would pass on
LEAKED = {var: "leaked" for var in SETTINGS_ENV_VARS}
LEAKED.update(GATEWAY_KEY_PREFIX="leaked-prefix:", REDIS_URL="redis://127.0.0.1:1/0", GATEWAY_CONFIG="/nonexistent.toml",
              GATEWAY_POOLS_JSON="[]", GATEWAY_MAX_PROMPT_TOKENS="7", GATEWAY_RESERVED_WORKER_SLOTS="0",
              GATEWAY_WORKER_SWITCH_INTERVAL_MS="1", GATEWAY_WORKER_GC_FREEZE="no")


def test_a_child_loads_the_parents_settings_not_the_inherited_environment(settings, monkeypatch):
    for var, value in LEAKED.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("GATEWAY_TEST_POOL_KEY", "sk-kept")          # an api_key_env variable: not a setting
    env = processes.child_env(settings)
    assert env["REDIS_URL"] == settings.redis_url
    assert {v for v in SETTINGS_ENV_VARS if v in env} == {"GATEWAY_SETTINGS_JSON", "REDIS_URL"}
    assert env["GATEWAY_TEST_POOL_KEY"] == "sk-kept"
    child = load_settings(env=env)
    assert json.loads(settings_to_json(child)) == json.loads(settings_to_json(settings))
    plain = plain_worker(settings.redis_url, "plain-prefix:", concurrency=1, pool="threads").env
    assert not [v for v in SETTINGS_ENV_VARS if v in plain] and plain["GATEWAY_TEST_POOL_KEY"] == "sk-kept"


@pytest.mark.slow
def test_a_bench_worker_comes_up_under_an_exported_key_prefix(settings, monkeypatch, tmp_path):
    """bench-overload's worker, started with GATEWAY_KEY_PREFIX exported in the bench's
    shell: it consumes the bench's prefix, so it answers the bench's ping."""
    from gateway_tasks.producer.gateway import Gateway

    monkeypatch.setenv("GATEWAY_KEY_PREFIX", "leaked-prefix:")
    gw = Gateway(settings)
    worker = processes.worker(settings, concurrency=1, name="bench-overload",
                              log_path=str(tmp_path / "worker.log")).start()
    try:
        assert processes.wait_for_workers(gw.app, 1, timeout_s=60.0) >= 1
    finally:
        worker.stop()
        gw.app.close()
        gw.r.close()
