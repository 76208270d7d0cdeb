"""Every documented way to configure a pool works end to end, through real processes
started with the environment a user sets (never GATEWAY_SETTINGS_JSON): a
`celery -A workers.app worker`, `gateway api`, the `gateway` commands, and the
upstream simulator requiring the pool's API key (401 otherwise), so a completed chat
completion proves the real key reached the upstream.

The ways: a GATEWAY_CONFIG TOML file whose pool holds its key inline (`api_key`) or
names the variable holding it (`api_key_env`), and GATEWAY_POOLS_JSON with either.
With `api_key_env` only the worker has the variable: the API, beat, Flower and the
CLI load the pool without its key, and a worker without it refuses to start.  Each
process says at start where its configuration came from; no log shows the key.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from gateway_tasks.core.settings import load_settings
from devtools import processes
from devtools.env_deployment import CONFIG_VARS, EnvDeployment
from gateway_tasks.simulator import SimConfig, SimulatorThread

pytestmark = pytest.mark.slow

KEY_VAR = "OPENAI_API_KEY"
POOLS_JSON_SOURCE = "built-in defaults (GATEWAY_CONFIG is unset), pools from GATEWAY_POOLS_JSON"


def pool_fields(base_url: str, key: str, *, inline: bool) -> dict:
    return {"name": "default", "base_url": base_url, **({"api_key": key} if inline else {"api_key_env": KEY_VAR}),
            "models": ["gpt-4o-mini", "gpt-4o"], "tpm": 600_000, "rpm": 6_000}


def toml_pool(fields: dict) -> str:
    return "[[pools]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())


def configure(way: str, tmp_path, base_url: str, key: str) -> tuple[dict[str, str], dict[str, str], str]:
    """(everyone's environment, the worker's own, the configuration source they should report)."""
    inline = way.endswith("inline_key")
    fields = pool_fields(base_url, key, inline=inline)
    worker_env = {} if inline else {KEY_VAR: key}
    if way.startswith("toml"):
        path = tmp_path / "gateway.toml"
        path.write_text(toml_pool(fields))
        return {"GATEWAY_CONFIG": str(path)}, worker_env, f"GATEWAY_CONFIG={path}"
    return {"GATEWAY_POOLS_JSON": json.dumps([fields])}, worker_env, POOLS_JSON_SOURCE


@pytest.mark.parametrize("way", ["toml_inline_key", "toml_api_key_env", "pools_json_inline_key",
                                 "pools_json_api_key_env"])
def test_a_way_to_configure_a_pool_serves_a_chat_completion(way, redis_url, r, key_prefix, tmp_path):
    key = f"sk-cfgway-{uuid.uuid4().hex}"
    also = ("beat", "flower") if way == "toml_api_key_env" else ()
    with SimulatorThread(SimConfig(base_latency_ms=1, api_key=key)) as sim:
        env, worker_env, source = configure(way, tmp_path, sim.base_url, key)
        env.update(REDIS_URL=redis_url, GATEWAY_KEY_PREFIX=key_prefix)
        with EnvDeployment(env, tmp_path, worker_env=worker_env) as deployment:
            deployment.start(also=also)
            tenant_key = deployment.add_tenant("acme", "vip")
            reply = deployment.chat(tenant_key, "Say hello")
            status = deployment.gateway("status")
            for name in also:   # beat and Flower start on a config naming a variable they lack
                deployment.wait_for_log(name, f"{name} configuration: {source}; pool default {sim.base_url}")
                assert deployment.children[name].alive(), deployment.log_tails()
            logs = deployment.logs()
        stats = sim.stats()
    assert reply.status_code == 200, (reply.text, deployment.log_tails())
    body = reply.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    # the simulator answers 401 to any other key: the pool's real key reached it
    assert stats["requests_ok"] >= 1 and stats["requests_unauthorized"] == 0, stats
    assert f"worker configuration: {source}; pool default {sim.base_url} (key present)" in logs["worker"]
    assert f"api configuration: {source}; pool default {sim.base_url}\n" in logs["api"]
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith(f"configuration: {source}\n  pool default {sim.base_url}\n"), status.stdout
    shown = {**logs, "gateway status": status.stdout + status.stderr}
    assert not [name for name, text in shown.items() if key in text]


def test_a_worker_without_its_pools_key_stops_at_start_naming_pool_and_variable(redis_url, key_prefix, tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(toml_pool(pool_fields("http://127.0.0.1:9/v1", "", inline=False)))
    env = {k: v for k, v in os.environ.items() if k not in (*CONFIG_VARS, KEY_VAR)}
    env.update(GATEWAY_CONFIG=str(path), REDIS_URL=redis_url, GATEWAY_KEY_PREFIX=key_prefix)
    settings = load_settings(env=env)
    assert settings.pools[0].api_key == ""          # loading is fine: a pool without its key here
    worker = processes.worker(settings, env=env, log_path=str(tmp_path / "worker.log"), loglevel="info").start()
    try:
        code = worker.process.wait(timeout=120)
    finally:
        worker.stop()
    log = (tmp_path / "worker.log").read_text()
    assert code == 78, log
    assert (f"gateway worker: configuration error: pool 'default': api_key_env='{KEY_VAR}' but {KEY_VAR} is not set in this worker's "
            f"environment; export {KEY_VAR}=<the upstream's API key>\n") in log
    assert f"worker configuration: GATEWAY_CONFIG={path}; pool default http://127.0.0.1:9/v1 " \
           f"(no key: {KEY_VAR} is not set)" in log
    assert "Traceback" not in log and "Unrecoverable" not in log and "ready." not in log
