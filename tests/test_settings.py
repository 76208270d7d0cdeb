"""Settings load from defaults, TOML, env and JSON, and fail fast with the reason."""

from __future__ import annotations

import json

import pytest

from gateway_tasks.dispatch.broker import channel_settings
from gateway_tasks.core.celery_app import PUBLIC_SETTINGS_OPTION
from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import Pool, load_settings, settings_from_json, settings_to_json


def test_defaults_follow_the_seeds():
    s = load_settings(env={})
    assert [(t.name, t.base_weight, t.aging_alpha_per_ms, t.share) for t in s.tiers] == [
        ("vip", 100, 0.05, 70), ("normal", 20, 0.02, 20), ("batch", 1, 0.005, 10)]
    assert [s.tier(a).jitter_window_s for a in ("enterprise", "pro", "free")] == [0, 120, 600]
    assert s.policy == "wfq"
    assert s.queue_names() == ["gt.vip.default", "gt.normal.default", "gt.batch.default"]


def test_toml_file_and_env_override(tmp_path):
    path = tmp_path / "gw.toml"
    path.write_text('''
policy = "aging"
[[tiers]]
name = "gold"
base_weight = 50
aging_alpha_per_ms = 0.01
share = 100
jitter_window_s = 0
max_wait_ms = 1000
max_concurrency_per_tenant = 4
max_tasks_per_hour = 10
retry_budget_ratio = 0.1
can_degrade = false
[[pools]]
name = "p1"
base_url = "http://127.0.0.1:9/v1"
api_key = "k"
models = ["m1", "m2"]
tpm = 1000
rpm = 10
''')
    s = load_settings(env={"GATEWAY_CONFIG": str(path), "GATEWAY_POLICY": "fifo",
                           "REDIS_URL": "redis://x:1/0"})
    assert s.policy == "fifo" and s.redis_url == "redis://x:1/0"
    assert s.tier("gold").base_weight == 50
    assert s.pool_for_model("m2").name == "p1"
    again = load_settings(env={"GATEWAY_SETTINGS_JSON": settings_to_json(s)})
    assert again == s


@pytest.mark.parametrize("env,text", [
    ({"GATEWAY_POLICY": "random"}, "policy"),
    ({"GATEWAY_MAX_PROMPT_TOKENS": "lots"}, "not a valid int"),
    ({"GATEWAY_CONFIG": "/nonexistent.toml"}, "file not found"),
    ({"GATEWAY_POOLS_JSON": "[{"}, "not valid JSON"),
    ({"GATEWAY_POOLS_JSON": '[{"name": "p", "base_url": "ftp://x", "api_key": "k", "models": ["m"], "tpm": 1, "rpm": 1}]'},
     "base_url"),
    ({"GATEWAY_POOLS_JSON": '[{"name": "p", "base_url": "http://x", "api_key": "k", "models": ["m"], "tpm": 0, "rpm": 1}]'},
     "tpm"),
    ({"GATEWAY_POOLS_JSON": '[{"name": "p", "colour": "red"}]'}, "unknown keys"),
    ({"GATEWAY_KEY_PREFIX": "nocolon"}, "key_prefix"),
    ({"GATEWAY_KEY_PREFIX": "gt:{one-slot}:"}, "key_prefix"),
    ({"GATEWAY_WORKER_SWITCH_INTERVAL_MS": "0"}, r"worker_switch_interval_ms=0\.0 is invalid; expected in \[0\.05, 1000\] ms"),
    ({"GATEWAY_WORKER_SWITCH_INTERVAL_MS": "nan"}, "worker_switch_interval_ms"),
    ({"GATEWAY_WORKER_SWITCH_INTERVAL_MS": "fast"}, "not a valid float"),
    ({"GATEWAY_WORKER_GC_FREEZE": "maybe"}, r"GATEWAY_WORKER_GC_FREEZE='maybe' is not a valid boolean \(not one of"),
])
def test_bad_settings_fail_fast_with_reason(env, text):
    with pytest.raises(ConfigError, match=text):
        load_settings(env=env)


def test_max_request_bytes_defaults_to_4_mib_and_must_be_positive():
    assert load_settings(env={}).max_request_bytes == 4_194_304
    assert load_settings(env={}, max_request_bytes=1_000).max_request_bytes == 1_000
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="max_request_bytes"):
            load_settings(env={}, max_request_bytes=bad)


def test_scheduled_lag_defaults_to_8192_tokens_and_must_be_a_whole_number():
    from dataclasses import replace

    s = load_settings(env={})
    assert [t.scheduled_lag_tokens for t in s.tiers] == [8192, 8192, 8192]
    assert s.with_(tiers=(replace(s.tiers[0], scheduled_lag_tokens=0),)).tiers[0].scheduled_lag_tokens == 0
    for bad in (-1, 1.5, True, "8192", 10**10):
        with pytest.raises(ConfigError, match="scheduled_lag_tokens"):
            s.with_(tiers=(replace(s.tiers[0], scheduled_lag_tokens=bad),))


def test_unknown_tier_and_model_name_the_choices():
    s = load_settings(env={})
    with pytest.raises(ConfigError, match="known tiers: vip, normal, batch"):
        s.tier("gold")
    with pytest.raises(ConfigError, match="served models"):
        s.pool_for_model("nope")


@pytest.mark.parametrize("deadline_s,ttl_s,expected", [
    (None, 0, (None, "deadline")),
    (5, 0, (5, "deadline")),
    (None, 30, (30, "queue_ttl")),
    (5, 30, (5, "deadline")),
    (60, 30, (30, "queue_ttl")),
])
def test_effective_deadline_table(deadline_s, ttl_s, expected):
    from workers.pipeline import effective_deadline_s
    assert effective_deadline_s(deadline_s, ttl_s) == expected


def test_api_key_env_reads_the_key_from_the_environment_and_never_shows_it():
    pools = '[{"name": "p", "base_url": "https://api.openai.com/v1", "api_key_env": "MY_UPSTREAM_KEY", ' \
            '"models": ["gpt-4o-mini"], "tpm": 1000, "rpm": 10}]'
    s = load_settings(env={"GATEWAY_POOLS_JSON": pools, "MY_UPSTREAM_KEY": "sk-from-env-123"})
    assert s.pools[0].api_key == "sk-from-env-123" and s.pools[0].key_problem() == ""
    assert "sk-from-env-123" not in repr(s)                   # reprs (logs) never show a key
    assert s.public().pools[0].api_key == "" and "sk-from-env" not in settings_to_json(s.public())
    no_key = pools.replace('"api_key_env": "MY_UPSTREAM_KEY", ', "")
    with pytest.raises(ConfigError, match="set api_key_env"):
        load_settings(env={"GATEWAY_POOLS_JSON": no_key})


def test_a_pool_whose_key_variable_is_unset_loads_without_its_key_and_a_worker_check_names_it():
    """Processes that do not call the upstream (API, beat, Flower, CLI) load it; the check a
    worker runs at start names the pool, the variable and how to set it."""
    pools = '[{"name": "p", "base_url": "https://api.openai.com/v1", "api_key_env": "MY_UPSTREAM_KEY", ' \
            '"models": ["gpt-4o-mini"], "tpm": 1000, "rpm": 10}]'
    s = load_settings(env={"GATEWAY_POOLS_JSON": pools})
    assert s.pools[0].api_key == "" and s.pools[0].api_key_env == "MY_UPSTREAM_KEY"
    s.require_keys([])                                            # a worker that calls no pool of it
    with pytest.raises(ConfigError) as err:
        s.require_keys(["p"])
    assert str(err.value) == ("pool 'p': api_key_env='MY_UPSTREAM_KEY' but MY_UPSTREAM_KEY is not set in this "
                              "worker's environment; export MY_UPSTREAM_KEY=<the upstream's API key>")


def test_the_public_view_in_transport_options_reloads_without_reading_any_key(monkeypatch):
    """celery_app puts settings.public() as JSON in the broker's transport options and every
    channel reloads it (broker.channel_settings): it must load where the variable is unset,
    and never read it where it is set."""
    pools = '[{"name": "p", "base_url": "https://api.openai.com/v1", "api_key_env": "MY_UPSTREAM_KEY", ' \
            '"models": ["gpt-4o-mini"], "tpm": 1000, "rpm": 10}]'
    full = load_settings(env={"GATEWAY_POOLS_JSON": pools, "MY_UPSTREAM_KEY": "sk-from-env-123"})
    monkeypatch.delenv("MY_UPSTREAM_KEY", raising=False)
    options = {PUBLIC_SETTINGS_OPTION: settings_to_json(full.public())}
    assert channel_settings(options).pools[0].api_key == ""
    monkeypatch.setenv("MY_UPSTREAM_KEY", "sk-from-env-456")
    public = settings_from_json(settings_to_json(full.public().with_(key_prefix="gt-public:")))
    assert public.pools[0].api_key == "" and public.pools[0] == full.public().pools[0]
    # a full settings JSON (GATEWAY_SETTINGS_JSON of a child process) keeps its inline key
    assert settings_from_json(settings_to_json(full)).pools[0].api_key == "sk-from-env-123"


def test_api_key_env_must_name_a_variable_and_a_key_put_there_is_never_echoed():
    pools = '[{"name": "p", "base_url": "https://api.openai.com/v1", "api_key_env": "sk-proj-SECRET123", ' \
            '"models": ["gpt-4o-mini"], "tpm": 1000, "rpm": 10}]'
    with pytest.raises(ConfigError, match="api_key_env is not an environment variable name") as err:
        load_settings(env={"GATEWAY_POOLS_JSON": pools})
    assert "SECRET123" not in str(err.value)


def test_settings_record_where_they_were_loaded_from(tmp_path):
    path = tmp_path / "gw.toml"
    path.write_text('policy = "fifo"\n')
    pools = '[{"name": "p", "base_url": "http://x/v1", "api_key": "k", "models": ["m"], "tpm": 1, "rpm": 1}]'
    assert load_settings(env={}).config_source == "built-in defaults (GATEWAY_CONFIG is unset)"
    assert load_settings(env={"GATEWAY_CONFIG": str(path)}).config_source == f"GATEWAY_CONFIG={path}"
    assert load_settings(env={"GATEWAY_CONFIG": str(path), "GATEWAY_POOLS_JSON": pools}).config_source == \
        f"GATEWAY_CONFIG={path}, pools from GATEWAY_POOLS_JSON"
    as_json = settings_to_json(load_settings(env={}))
    assert "config_source" not in json.loads(as_json)
    assert load_settings(env={"GATEWAY_SETTINGS_JSON": as_json, "GATEWAY_CONFIG": str(path)}).config_source == \
        f"GATEWAY_SETTINGS_JSON (GATEWAY_CONFIG={path} ignored)"
    assert load_settings(env={}, key_prefix="x:").config_source.endswith(", overridden in code: key_prefix")
    with pytest.raises(ConfigError, match="config_source is not a setting"):
        load_settings(env={"GATEWAY_SETTINGS_JSON": '{"config_source": "elsewhere"}'})


def test_public_view_drops_credentials_from_urls():
    s = load_settings(env={}).with_(pools=(Pool("p", base_url="https://user:pw@llm.example/v1",
                                                api_key="k", models=("m",), tpm=1, rpm=1),))
    assert s.public().pools[0].base_url == "https://llm.example/v1"
    with_password = s.with_(redis_url="redis://:hunter2@redis.example:6379/0?password=hunter2")
    assert "hunter2" not in settings_to_json(with_password.public())


def test_worker_switch_interval_defaults_to_cpythons_and_reads_the_environment():
    assert load_settings(env={}).worker_switch_interval_ms == 5.0
    assert load_settings(env={"GATEWAY_WORKER_SWITCH_INTERVAL_MS": "0.5"}).worker_switch_interval_ms == 0.5


@pytest.mark.parametrize("text,expected", [("1", True), ("true", True), ("Yes", True), ("ON", True),
                                           ("0", False), ("false", False), ("no", False), (" off ", False)])
def test_worker_gc_freeze_is_on_by_default_and_reads_a_yes_or_no(text, expected):
    assert load_settings(env={}).worker_gc_freeze is True
    assert load_settings(env={"GATEWAY_WORKER_GC_FREEZE": text}).worker_gc_freeze is expected


def test_worker_gc_freeze_must_be_a_bool_in_a_file_too():
    with pytest.raises(ConfigError, match="worker_gc_freeze='yes' is invalid; expected true or false"):
        load_settings(env={"GATEWAY_SETTINGS_JSON": '{"worker_gc_freeze": "yes"}'})


def test_max_json_depth_defaults_to_64_and_must_be_a_sane_integer():
    assert load_settings(env={}).max_json_depth == 64
    assert load_settings(env={}, max_json_depth=8).max_json_depth == 8
    for bad in (0, 3, 513, True, 10.5):
        with pytest.raises(ConfigError, match="max_json_depth"):
            load_settings(env={}, max_json_depth=bad)
