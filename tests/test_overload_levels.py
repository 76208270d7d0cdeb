"""Load levels as pure functions: signals -> target level, hysteresis, measurement windows,
and each level's actions: the degradation table (the design document's, the presets,
configured cells), dispatch-time actions, deferral times.  No Redis."""

from __future__ import annotations

import pytest

from gateway_tasks.core.errors import ConfigError, Deferred, Rejected
from gateway_tasks.overload.actions import (Action, Request, action_for, degrade, deferral_error,
                                            dispatch_action, record)
from gateway_tasks.overload.deferral import deferred_until_ms, in_window, release_room, within_room
from gateway_tasks.overload.levels import (NEVER, QueuedWork, Signals, backlog_seconds, baseline, hysteresis, measure,
                                           pool_backlog_tokens, startable_tasks, target_level, tier_latency_s)
from gateway_tasks.core.settings import LevelAction, Overload, Pool, Settings, load_settings

O = Overload()
MAX_WAIT = {"vip": 2_000, "normal": 30_000, "batch": 300_000}


@pytest.mark.parametrize("signals, level, why", [
    (Signals(), 0, "below"),
    (Signals(utilisation={"p": 0.74}), 0, "below"),
    (Signals(utilisation={"p": 0.75}), 0, "below"),            # > 0.75, not >= (the document)
    (Signals(utilisation={"p": 0.76}), 1, "utilisation 0.76"),
    (Signals(utilisation={"p": 0.86}), 2, "> 0.85"),
    (Signals(utilisation={"p": 0.95}), 2, "> 0.85"),
    (Signals(utilisation={"p": 0.951}), 3, "> 0.95"),
    (Signals(utilisation={"a": 0.2, "b": 1.3}), 3, "pool b"),
    (Signals(error_rate={"p": 0.1}), 0, "below"),              # > 0.1, not >=
    (Signals(error_rate={"p": 0.11}), 4, "error rate 0.11"),  # the document: error rate > 0.1 -> L4
    (Signals(error_rate={"p": None}), 0, "below"),             # too few calls to judge
    (Signals(queue_depth=10_000), 0, "below"),
    (Signals(queue_depth=10_001), 4, "10001 tasks queued"),
    (Signals(utilisation={"p": 0.8}, queue_depth=20_000), 4, "queued"),
    (Signals(wait_ms={"vip": 2_500.0}), 3, "tier vip waited 2.5 s"),
    (Signals(wait_ms={"batch": 200_000.0, "vip": None}), 0, "below"),
    (Signals(oldest_wait_ms={"normal": 31_000.0}), 3, "tier normal's oldest queued task has waited 31.0 s"),
    (Signals(oldest_wait_ms={"normal": 29_000.0, "vip": 1_900.0}), 0, "below"),
    # the queue's backlog, seconds of the pool's TPM, over the 10 s window: the utilisation
    # the pool is committed to before the window has seen any of it
    (Signals(backlog_s={"p": 7.4}), 0, "below"),
    (Signals(backlog_s={"p": 7.5}), 0, "below"),
    (Signals(backlog_s={"p": 7.6}), 1, "pool p's queue holds 7.6 s of its TPM: utilisation 0.76"),
    (Signals(backlog_s={"p": 9.6}), 3, "utilisation 0.96 of the next 10 s > 0.95"),
    (Signals(backlog_s={"a": 1.0, "b": 60.0}), 3, "pool b's queue holds 60.0 s"),
    (Signals(utilisation={"p": 0.9}, backlog_s={"p": 1.0}), 2, "pool p utilisation 0.90"),
])
def test_target_level_table(signals, level, why):
    got, reason = target_level(signals, O, MAX_WAIT)
    assert got == level and why in reason, reason


@pytest.mark.parametrize("window_s, backlog_s, level", [
    (10.0, 9.6, 3), (20.0, 9.5, 0), (20.0, 17.5, 2), (5.0, 4.0, 1), (5.0, 4.3, 2),
])
def test_backlog_is_judged_against_the_window(window_s, backlog_s, level):
    overload = Overload(window_s=window_s)
    assert target_level(Signals(backlog_s={"p": backlog_s}), overload, MAX_WAIT)[0] == level


def test_backlog_signal_off_leaves_only_what_has_been_served():
    off = Overload(backlog_signal=False)
    assert target_level(Signals(backlog_s={"p": 600.0}), off, MAX_WAIT) == (0, "all signals below their thresholds")
    assert target_level(Signals(utilisation={"p": 0.96}, backlog_s={"p": 600.0}), off, MAX_WAIT)[0] == 3


@pytest.mark.parametrize("tokens, tpm, expected", [
    ({"p": 10_000}, {"p": 60_000}, {"p": 10.0}),      # 10k tokens of a 1,000 tokens/s pool
    ({"p": 0}, {"p": 60_000}, {"p": 0.0}),
    ({"p": 500, "q": 500}, {"p": 120_000, "q": 0}, {"p": 0.25}),   # a pool with no TPM is not judged
])
def test_backlog_seconds_table(tokens, tpm, expected):
    assert backlog_seconds(tokens, tpm) == expected


HOLD = 30_000


@pytest.mark.parametrize("steps", [
    # (now_ms, target, expected level)
    [(0, 0, 0), (1_000, 3, 3), (2_000, 0, 3), (30_999, 0, 3), (31_000, 0, 0)],      # rises at once, one hold
    [(0, 2, 2), (1_000, 1, 2), (30_000, 1, 1), (31_000, 0, 1), (60_999, 0, 0)],    # each level its own hold
    [(0, 3, 3), (10_000, 1, 3), (29_000, 2, 3), (30_000, 0, 2), (59_000, 0, 0)],   # falls to what was asked
    [(0, 1, 1), (1_000, 0, 1), (2_000, 1, 1), (3_000, 0, 1), (31_000, 0, 1),        # hovering: no flapping
     (32_000, 0, 0)],
    [(0, 4, 4), (1_000, 2, 4), (30_999, 2, 2), (31_000, 4, 4)],                     # and back up at once
])
def test_hysteresis_rises_fast_and_falls_after_the_hold(steps):
    seen = NEVER
    for now, target, expected in steps:
        seen, level = hysteresis(seen, target, now, HOLD)
        assert level == expected, (now, target, level)


def test_a_level_changes_at_most_once_per_hold_on_a_noisy_signal():
    seen, changes, last = NEVER, 0, 0
    for t in range(0, 120_000, 1_000):
        target = 1 if (t // 1000) % 3 == 0 else 0       # a signal crossing 0.75 every 3 s
        seen, level = hysteresis(seen, target, t, HOLD)
        changes += level != last
        last = level
    assert changes == 1 and last == 1


def sample(ts, tokens=0, ok=0, errors=0, r429=0, dispatched=0, wait_ms=0):
    return {"ts_ms": ts, "pools": {"p": {"tokens": tokens, "ok": ok, "errors": errors, "r429": r429}},
            "tiers": {"vip": {"dispatched": dispatched, "wait_ms": wait_ms}}}


def test_measure_rates_over_the_window():
    old, now = sample(0), sample(10_000, tokens=90_000, ok=80, errors=15, r429=5, dispatched=4, wait_ms=400)
    s = measure(now, old, {"p": 600_000}, queue_depth=7, min_calls=20)
    assert s.window_ms == 10_000
    assert s.utilisation["p"] == pytest.approx(0.9)          # 90k tokens in 10 s of a 600k TPM pool
    assert s.error_rate["p"] == pytest.approx(0.2) and s.calls["p"] == 100
    assert s.wait_ms["vip"] == 100.0 and s.queue_depth == 7
    few = measure(sample(10_000, ok=5, errors=5), old, {"p": 600_000}, 0, min_calls=20)
    assert few.error_rate["p"] is None                        # 10 calls: not judged
    assert measure(now, None, {"p": 1}, 3, 20) == Signals(queue_depth=3)
    storm = {"p": [QueuedWork("batch", 500, 100.0, 500, 2)]}   # 500 tenants, one task each
    young = measure(now, None, {"p": 600_000}, 3, 20, queued=storm)
    assert young.backlog_s == {"p": 5.0}                      # known before there is a window
    assert measure(now, old, {"p": 600_000}, 7, 20, queued={"p": storm["p"] * 2}).backlog_s == {"p": 10.0}
    bulk = {"p": [QueuedWork("batch", 500, 100.0, 1, 2)]}     # one tenant's 500, 2 at a time
    assert measure(now, old, {"p": 600_000}, 7, 20, queued=bulk, window_s=10.0).backlog_s == {"p": 0.02}


@pytest.mark.parametrize("queue, latency_s, expected", [
    (QueuedWork("t", 500, 10.0, 500, 2), None, 500.0),        # a storm: a task each, all startable
    (QueuedWork("t", 500, 10.0, 1, 2), None, 2.0),            # one tenant's bulk: its cap, once
    (QueuedWork("t", 500, 10.0, 1, 2), 2.5, 8.0),             # ... each slot 10 s / 2.5 s = 4 times
    (QueuedWork("t", 500, 10.0, 1, 2), 30.0, 2.0),            # slow calls: at least once a window
    (QueuedWork("t", 500, 10.0, 0, 2), 1.0, 0.0),             # every tenant parked at its cap
    (QueuedWork("t", 500, 10.0, 1, 0), 1.0, 500.0),           # no cap: all of it
    (QueuedWork("t", 3, 10.0, 100, 50), 0.1, 3.0),            # never more than is queued
])
def test_startable_tasks_table(queue, latency_s, expected):
    assert startable_tasks(queue, 10.0, latency_s) == expected


def test_pool_backlog_sums_its_tiers():
    queues = [QueuedWork("vip", 10, 200.0, 10, 50), QueuedWork("batch", 1000, 50.0, 1, 2)]
    assert pool_backlog_tokens(queues, 10.0, {"vip": 1.0, "batch": 5.0}) == 10 * 200.0 + 4 * 50.0


@pytest.mark.parametrize("now, old, expected", [
    ({"tiers": {"vip": {"completed": 30, "upstream_ms": 45_000}}},
     {"tiers": {"vip": {"completed": 10, "upstream_ms": 5_000}}}, {"vip": 2.0}),      # over the window
    ({"tiers": {"vip": {"completed": 10, "upstream_ms": 5_000}}},
     {"tiers": {"vip": {"completed": 10, "upstream_ms": 5_000}}}, {"vip": 0.5}),      # none: all so far
    ({"tiers": {"vip": {"completed": 4, "upstream_ms": 2_000}}}, None, {"vip": 0.5}),
    ({"tiers": {"batch": {"dispatched": 3}}}, None, {"batch": None}),                 # none ever
])
def test_tier_latency_table(now, old, expected):
    assert tier_latency_s(now, old) == expected


@pytest.mark.parametrize("stored, now, window, expected", [
    ([], 10_000, 10_000, None),
    ([9_000, 8_000], 10_000, 10_000, 8_000),                  # young: the oldest there is
    ([9_000, 1_000, 0], 10_000, 10_000, 0),                   # the newest a whole window old
    ([10_000], 10_000, 10_000, None),                          # nothing older than now
    ([12_000, 2_000, 500], 12_500, 10_000, 2_000),
])
def test_baseline_table(stored, now, window, expected):
    got = baseline([sample(t) for t in stored], now, window)
    assert (got["ts_ms"] if got else None) == expected


# -- actions per level: the degradation table ---------------------------------------
S = Settings()
VIP, NORMAL, BATCH = S.tier("vip"), S.tier("normal"), S.tier("batch")
SERVED = {"gpt-4o", "gpt-4o-mini"}
X, D = "execute", "defer"


@pytest.mark.parametrize("level, tier, requested, kind, max_tokens, fallback, retry_s, reason", [
    # the design document's table, cell by cell (free = batch, pro = normal, enterprise = vip)
    *[(0, t, 4096, X, 4096, False, 0, "") for t in (VIP, NORMAL, BATCH)],
    (1, VIP, 4096, X, 4096, False, 0, ""), (1, NORMAL, 4096, X, 4096, False, 0, ""),
    (1, BATCH, 4096, X, 2048, False, 0, ""), (1, BATCH, 100, X, 100, False, 0, ""),   # min(requested, 2048)
    (2, VIP, 4096, X, 4096, False, 0, ""),
    (2, NORMAL, 4096, X, 2048, False, 0, ""), (2, NORMAL, 500, X, 500, False, 0, ""),
    (2, BATCH, 4096, X, 1024, True, 0, ""), (2, BATCH, 100, X, 1024, True, 0, ""),    # fixed 1024, fallback
    (3, VIP, 4096, X, 4096, False, 0, ""),
    (3, NORMAL, 4096, D, 4096, False, 300, "capacity_pressure"),
    (3, BATCH, 4096, D, 4096, False, 300, "capacity_pressure"),
    (4, VIP, 4096, X, 2048, False, 0, ""), (4, VIP, 64, X, 64, False, 0, ""),
    (4, NORMAL, 4096, D, 4096, False, 600, "system_overload"),
    (4, BATCH, 4096, D, 4096, False, 600, "system_overload"),
])
def test_the_design_documents_table_is_the_default(level, tier, requested, kind, max_tokens, fallback,
                                                    retry_s, reason):
    assert action_for(O, level, tier, Request(requested, "gpt-4o")) == Action(
        kind, level, tier.name, max_tokens, fallback, float(retry_s), reason)


@pytest.mark.parametrize("level, tier, kind, max_tokens, fallback, retry_s", [
    (1, NORMAL, X, 2048, False, 0), (1, BATCH, X, 2048, False, 0),
    (2, NORMAL, X, 1024, True, 0), (3, NORMAL, X, 1024, True, 0),
    (3, BATCH, D, 4096, False, 600), (4, NORMAL, D, 4096, False, 300), (4, VIP, X, 4096, False, 0),
])
def test_the_project_preset_keeps_the_earlier_table(level, tier, kind, max_tokens, fallback, retry_s):
    o = Overload(degradation="project")
    degradable = {"normal": NORMAL.__class__(**{**NORMAL.__dict__, "can_degrade": True})}
    t = degradable.get(tier.name, tier)
    a = action_for(o, level, t, Request(4096))
    assert (a.kind, a.max_tokens, a.fallback, a.retry_after_s) == (kind, max_tokens, fallback, retry_s)
    with pytest.raises(ConfigError, match=r"\[overload.actions.L2.pro\]: model='fallback'.*can_degrade"):
        S.with_(overload=o)                           # normal keeps can_degrade = false: refused
    S.with_(overload=o, tiers=(VIP, degradable["normal"], BATCH))


def test_a_configured_cell_replaces_the_presets_and_none_degrades_nothing():
    o = Overload(actions=(LevelAction(3, "batch", "defer", retry_after_s=86_400, reason="night_batch"),
                          LevelAction(1, "enterprise", max_tokens_cap=512)))
    assert action_for(o, 3, BATCH, Request(10)) == Action(D, 3, "batch", 10, False, 86_400.0, "night_batch")
    assert action_for(o, 1, VIP, Request(4096)).max_tokens == 512         # matched by alias
    assert action_for(o, 3, NORMAL, Request(10)).reason == "capacity_pressure"   # the preset's still
    assert all(action_for(Overload(degradation="none"), k, t, Request(9)).kind == X
               for k in range(5) for t in (VIP, NORMAL, BATCH))


@pytest.mark.parametrize("level, tier, requested, max_tokens, fallback", [
    (0, BATCH, 4096, 4096, False),
    (2, BATCH, 100, 100, True),          # fixed 1024 at dispatch never raises a request's max_tokens
    (3, BATCH, 4096, 1024, True),        # L3 defers batch: work already accepted gets L2's execute
    (4, NORMAL, 4096, 2048, False),      # L4 and L3 defer pro: L2's cap
    (4, VIP, 4096, 2048, False),
])
def test_dispatch_action_table(level, tier, requested, max_tokens, fallback):
    a = dispatch_action(O, level, tier, Request(requested))
    assert (a.kind, a.max_tokens, a.fallback, a.level) == (X, max_tokens, fallback, level)


def act(tier, level, model="gpt-4o", max_tokens=4_000, at_dispatch=False):
    return degrade(O, tier, level, model, max_tokens, lambda m: O.fallback_for(m), lambda m: m in SERVED,
                   at_dispatch=at_dispatch)


@pytest.mark.parametrize("tier, level, model, max_tokens, exp_model, exp_tokens", [
    (BATCH, 0, "gpt-4o", 4_000, "gpt-4o", 4_000),
    (BATCH, 1, "gpt-4o", 4_000, "gpt-4o", 2_048),             # L1: cap 2048
    (BATCH, 1, "gpt-4o", 100, "gpt-4o", 100),                 # a cap never raises
    (BATCH, 2, "gpt-4o", 4_000, "gpt-4o-mini", 1_024),        # L2: 1024 + fallback model
    (NORMAL, 2, "gpt-4o", 4_000, "gpt-4o", 2_048),            # pro: cap, its model kept
    (BATCH, 2, "gpt-4o-mini", 4_000, "gpt-4o-mini", 1_024),   # no fallback of the fallback
    (BATCH, 3, "gpt-4o", 4_000, "gpt-4o", 4_000),             # a defer changes nothing
    (VIP, 3, "gpt-4o", 4_000, "gpt-4o", 4_000),
])
def test_degrade_table(tier, level, model, max_tokens, exp_model, exp_tokens):
    d = act(tier, level, model, max_tokens)
    assert (d.model, d.max_tokens) == (exp_model, exp_tokens)
    assert d.changed == ((exp_model, exp_tokens) != (model, max_tokens))


def test_fallback_only_to_a_model_the_caller_can_route_to():
    d = degrade(O, BATCH, 2, "gpt-4o", 10, lambda m: O.fallback_for(m), lambda m: m == "gpt-4o")
    assert d.model == "gpt-4o"


def test_fallback_map_then_the_pools_fallback_model():
    o = Overload(fallback_models=(("big", "small"),))
    assert o.fallback_for("big", "other") == "small"          # the map first
    assert o.fallback_for("mid", "small") == "small"          # then the pool's fallback_model
    assert o.fallback_for("small", "small") == ""             # never itself
    assert o.fallback_for("mid") == ""


def test_a_refused_deferral_carries_the_code_the_sentence_and_the_retry():
    a = action_for(O, 4, NORMAL, Request(10))
    got = deferral_error(a, "pool p utilisation 1.00 > 0.95")
    assert isinstance(got, Rejected) and isinstance(got, Deferred)
    assert (got.reason, got.retry_after_s, got.level) == ("system_overload", 600.0, 4)
    assert str(got) == ("load level L4: new normal work is deferred (system_overload): pool p utilisation "
                        "1.00 > 0.95; retry after 600 s")
    assert got.details() == {"reason": "system_overload", "retry_after_s": 600.0, "level": 4}


H = 3_600_000
MIDNIGHT = 1_767_225_600_000          # 2026-01-01T00:00:00Z


@pytest.mark.parametrize("now_ms, retry_s, window, tz, expected", [
    (MIDNIGHT + 12 * H, 300, "", "UTC", MIDNIGHT + 12 * H + 300_000),            # no window: the retry time
    (MIDNIGHT + 12 * H, 86_400, "00:00-06:00", "UTC", MIDNIGHT + 24 * H),       # the window opens first
    (MIDNIGHT + 12 * H, 300, "00:00-06:00", "UTC", MIDNIGHT + 12 * H + 300_000),  # the retry comes first
    (MIDNIGHT + 3 * H, 86_400, "00:00-06:00", "UTC", MIDNIGHT + 3 * H),         # inside it: at once
    (MIDNIGHT + 6 * H, 86_400, "00:00-06:00", "UTC", MIDNIGHT + 24 * H),        # its end is outside
    (MIDNIGHT + 23 * H, 86_400, "22:00-02:00", "UTC", MIDNIGHT + 23 * H),       # spans midnight
    (MIDNIGHT + 12 * H, 86_400, "00:00-06:00", "Asia/Shanghai", MIDNIGHT + 16 * H),   # 00:00 +08:00
])
def test_deferred_until_table(now_ms, retry_s, window, tz, expected):
    assert deferred_until_ms(now_ms, retry_s, window, tz) == expected
    assert in_window(now_ms, window, tz) == (expected == now_ms)


def test_record_says_what_changed():
    rec = record({"level": 2, "requested_max_tokens": 4000, "requested_model": "gpt-4o"}, 3,
                 max_tokens=1024, model="gpt-4o-mini", pool="p", requested_pool="p")
    assert rec["level_at_submit"] == 2 and rec["level_at_dispatch"] == 3
    assert rec["max_tokens"] == {"requested": 4000, "used": 1024, "capped": True}
    assert rec["model"]["substituted"] and not rec["pool"]["failover"] and rec["changed"]
    plain = record({}, 0, max_tokens=5, model="m", pool="p", requested_pool="p")
    assert not plain["changed"] and plain["level_at_submit"] == 0


@pytest.mark.parametrize("text, names", [
    ("[overload]\nutilisation_thresholds = [0.9, 0.8, 0.95]\n", "utilisation_thresholds"),
    ("[overload]\nmax_tokens_caps = [1, 2]\n", "unknown keys"),
    ("[overload]\ndegradation = \"doc\"\n", "degradation='doc'"),
    ("[overload.actions.L3.batch]\naction = \"defer\"\n", r"\[overload.actions.L3.batch\]: retry_after_s=0"),
    ("[overload.actions.L3.batch]\naction = \"defer\"\nretry_after_s = 60\nreason = \"Busy now\"\n",
     r"\[overload.actions.L3.batch\]: reason='Busy now'"),
    ("[overload.actions.L2.pro]\nmax_tokens_cap = 100\nmax_tokens = 50\n", r"\[overload.actions.L2.pro\]: max_tokens=50"),
    ("[overload.actions.L2.pro]\nmodel = \"fallback\"\n", r"\[overload.actions.L2.pro\]: model='fallback'.*can_degrade"),
    ("[overload.actions.L2.gold]\nmax_tokens_cap = 100\n", r"\[overload.actions.L2.gold\]: tier='gold'"),
    ("[overload.actions.L5.batch]\nmax_tokens_cap = 100\n", r"\[overload.actions.L5.batch\]: level=5"),
    ("[overload.actions.L2.batch]\nmax_tokens_cap = 100\nspeed = 1\n", r"\[overload.actions.L2.batch\]: unknown keys"),
    ("[overload]\noff_peak_timezone = \"Mars/Olympus\"\n", "off_peak_timezone"),
    ("[[tiers]]\nname = \"t\"\nbase_weight = 1\naging_alpha_per_ms = 0\nshare = 100\njitter_window_s = 0\n"
     "max_wait_ms = 1\nmax_concurrency_per_tenant = 1\nmax_tasks_per_hour = 1\nretry_budget_ratio = 0\n"
     "can_degrade = false\noff_peak = \"25:00-06:00\"\n", "off_peak='25:00-06:00'"),
    ("[overload]\nhold_s = 0\n", "hold_s"),
    ("[overload]\nbogus = 1\n", "unknown keys"),
    ("[overload]\nbacklog_signal = \"yes\"\n", "backlog_signal"),
    ("[overload]\nfallback_models = { \"gpt-4o\" = \"nowhere\" }\n", "fallback_models"),
    ("[circuit]\nfailure_threshold = 0\n", "failure_threshold"),
])
def test_bad_overload_settings_fail_fast(tmp_path, text, names):
    path = tmp_path / "gw.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=names):
        load_settings(env={"GATEWAY_CONFIG": str(path)})


def test_backups_must_exist():
    pool = Pool("a", base_url="http://x/v1", api_key="k", models=("m",), tpm=1, rpm=1, backup_pools=("zz",))
    with pytest.raises(ConfigError, match="backup_pools"):
        S.with_(pools=(pool,))
    with pytest.raises(ConfigError, match="fallback_model"):
        S.with_(pools=(Pool("a", base_url="http://x/v1", api_key="k", models=("m",), tpm=1, rpm=1,
                            fallback_model="nowhere"),))


def test_overload_settings_round_trip_through_toml_and_json(tmp_path):
    from gateway_tasks.core.settings import settings_to_json
    path = tmp_path / "gw.toml"
    path.write_text("[overload]\nhold_s = 12\nfallback_models = { \"gpt-4o\" = \"gpt-4o-mini\" }\n"
                    "[overload.actions.L3.free]\naction = \"defer\"\nretry_after_s = 900\nreason = \"night\"\n"
                    "[circuit]\nopen_s = 1.5\n")
    s = load_settings(env={"GATEWAY_CONFIG": str(path)})
    assert s.overload.hold_s == 12 and s.circuit.open_s == 1.5
    assert s.overload.actions == (LevelAction(3, "free", "defer", retry_after_s=900, reason="night"),)
    assert load_settings(env={"GATEWAY_SETTINGS_JSON": settings_to_json(s)}) == s


def test_the_documents_fallback_map_is_the_default():
    o = Overload()
    assert dict(o.fallback_models) == {"claude-sonnet-4-6": "claude-haiku-4-5-20251001",
                                       "gpt-4o": "gpt-4o-mini", "deepseek-r1": "deepseek-v3"}
    assert [o.fallback_for(m) for m in ("claude-sonnet-4-6", "deepseek-r1", "gpt-4o-mini")] == \
        ["claude-haiku-4-5-20251001", "deepseek-v3", ""]


@pytest.mark.parametrize("candidates, room, expected", [
    ([("a", "p", 100), ("b", "p", 100), ("c", "p", 100)], {"p": 250.0}, ["a", "b"]),
    ([("a", "p", 900), ("b", "p", 10)], {"p": 250.0}, ["a"]),         # the first goes even if larger
    ([("a", "p", 100), ("b", "q", 100)], {"p": 0.0, "q": 100.0}, ["b"]),   # no room: none of p
    ([("a", "", 0)], {"p": 10.0}, []),                                  # its record is gone
])
def test_within_room_table(candidates, room, expected):
    assert within_room(candidates, room) == expected


@pytest.mark.parametrize("util, backlog_s, expected", [
    (0.0, 0.0, 0.75 * 10_000),          # idle: 0.75 of one 1 s tick of a 600k TPM pool
    (0.5, 0.0, 0.25 * 10_000),
    (0.2, 6.0, 0.15 * 10_000),          # the larger of the two counts (6 s of a 10 s window)
    (0.9, 0.0, 0.0),
])
def test_release_room_table(util, backlog_s, expected):
    signals = Signals(utilisation={"default": util}, backlog_s={"default": backlog_s})
    assert release_room(signals, S)["default"] == pytest.approx(expected)
