"""Redis unreachable, or a bad configuration, is one clear line everywhere.

* every `gateway` command that touches Redis, run as a real process against a closed
  loopback port: one line on stderr naming the Redis (no password), nothing on stdout,
  exit status 69;
* a bad configuration (no REDIS_URL, GATEWAY_CONFIG naming a missing file or holding an
  invalid value, a worker's -Q queue of an unknown tier) for `gateway` commands, a worker,
  beat and Flower started as real processes: one line, no traceback, exit status 78;
* the REST API's 503s with the gateway's Redis stopped or full name no address, port,
  key prefix or Redis command: the gateway's words, with Retry-After.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from celery.exceptions import BackendGetMetaError
from fastapi.testclient import TestClient

from gateway_tasks.cli.main import run_command
from gateway_tasks.core.errors import EXIT_CONFIG, EXIT_REDIS_UNAVAILABLE, RedisFull, RedisUnavailable
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.redis_failures import as_unavailable, cause_of, unavailable_line
from gateway_tasks.core.settings import Pool, load_settings
from gateway_tasks.local.ports import free_port
from gateway_tasks.local.redis_server import EmbeddedRedis
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app
from gateway_tasks.rest.streaming import events

pytestmark = pytest.mark.slow   # real processes: gateway commands, workers, beat, Flower, Redis
ROOT = Path(__file__).resolve().parent.parent
SECRET = "pw-" + uuid.uuid4().hex[:10]
WAIT_S = 60          # a process that does not stop by then has failed the test
# words of Redis commands and of redis-py's messages that a client must never be shown
REDIS_WORDS = ("SET ", "HSET", "EVALSHA", "ZADD", "XREAD", "maxmemory", "Error 111", "connecting to",
               "127.0.0.1")


def _env(**changes: str | None) -> dict[str, str]:
    """This process's environment without the deployment's settings, then ``changes``
    (None removes a variable)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GATEWAY_", "REDIS_")) and k != "VIRTUAL_ENV"}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONWARNINGS"] = "ignore"     # Celery's warning about running as root, in containers
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)


def gateway(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "gateway_tasks.cli", *args], env)


def celery(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "celery", *args], env)


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    return free_port()


@pytest.fixture
def bad_toml(tmp_path) -> str:
    path = tmp_path / "gateway.toml"
    path.write_text('policy = "fifo-ish"\n')
    return str(path)


# -- Redis unreachable: every command that touches it ------------------------------------
REDIS_COMMANDS = [
    ("tenant", "add", "acme", "--tier", "vip"),
    ("tenant", "list"),
    ("tenant", "delete", "acme"),
    ("cron", "add", "acme", "digest", "0 * * * *", "--prompt", "Summarise the news"),
    ("cron", "list"),
    ("cron", "delete", "acme", "digest"),
    ("task", "cancel", "0b5e9a4e-6f1c-4c1e-9d6a-1f2e3d4c5b6a"),
    ("dead-letters",),
    ("status",),
    ("metrics",),
    ("capacity", "forecast"),
    ("capacity", "--measure-s", "1", "--peak-qps", "10"),
]


def assert_unreachable(out: subprocess.CompletedProcess, port: int) -> None:
    """Exit status 69, nothing on stdout, one line on stderr naming the Redis (no password)."""
    assert out.returncode == EXIT_REDIS_UNAVAILABLE, out.stderr
    assert out.stdout == ""
    assert out.stderr.splitlines() == [
        f"gateway: Redis at redis://127.0.0.1:{port}/0 is unreachable (connection refused); check REDIS_URL"]


@pytest.mark.parametrize("argv", REDIS_COMMANDS, ids=" ".join)
def test_redis_unreachable_is_one_line_and_exit_69(argv, closed_port):
    assert_unreachable(gateway(*argv, env=_env(REDIS_URL=f"redis://gateway:{SECRET}@127.0.0.1:{closed_port}/0")),
                       closed_port)


def test_a_password_given_apart_is_not_shown_either(closed_port):
    env = _env(REDIS_URL=f"redis://127.0.0.1:{closed_port}/0", REDIS_PASSWORD=SECRET)
    out = gateway("tenant", "list", env=env)
    assert out.returncode == EXIT_REDIS_UNAVAILABLE and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and SECRET not in out.stderr
    assert f"127.0.0.1:{closed_port}/0 is unreachable" in out.stderr


def test_the_readme_key_line_stops_with_the_gateway_line(closed_port):
    """The walk-through's TENANT/KEY/curl lines under `bash -e` with Redis down: the tenant
    line's one error and exit status; the key is never parsed and curl never runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("TENANT=$(gateway tenant add")
    end = readme.index("\ngateway cron add", start)
    lines = readme[start:end]
    assert "${KEY:?" in lines
    out = _run(["bash", "-e", "-c", lines.replace("curl ", "echo CURL-RAN ")],
               _env(REDIS_URL=f"redis://127.0.0.1:{closed_port}/0"))
    assert_unreachable(out, closed_port)


# -- a bad configuration: gateway commands ------------------------------------------------
def test_gateway_commands_without_redis_url(closed_port):
    for argv in (("tenant", "add", "acme", "--tier", "vip"), ("cron", "list"), ("api",), ("flower",)):
        out = gateway(*argv, env=_env())
        assert out.returncode == EXIT_CONFIG, (argv, out.stderr)
        assert out.stdout == ""
        [line] = out.stderr.splitlines()
        assert line.startswith("gateway: ") and "needs REDIS_URL" in line, line


def test_gateway_commands_with_a_bad_config_file(closed_port, bad_toml, tmp_path):
    url = f"redis://127.0.0.1:{closed_port}/0"
    missing = str(tmp_path / "nope.toml")
    for config, expected in ((missing, f"gateway: GATEWAY_CONFIG={missing!r}: file not found"),
                             (bad_toml, "gateway: settings: policy='fifo-ish' is invalid; expected one of")):
        out = gateway("tenant", "add", "acme", "--tier", "vip", env=_env(REDIS_URL=url, GATEWAY_CONFIG=config))
        assert out.returncode == EXIT_CONFIG and out.stdout == ""
        [line] = out.stderr.splitlines()
        assert line.startswith(expected), line


# -- a bad configuration: worker, beat, Flower --------------------------------------------
WORKER = ("-A", "workers.app", "worker", "-P", "threads", "-c", "1", "--without-mingle",
          "--without-gossip")


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_worker_and_beat_without_redis_url(process):
    argv = WORKER if process == "worker" else ("-A", "beat.app", "beat")
    out = celery(*argv, env=_env())
    assert out.returncode == EXIT_CONFIG, out.stderr[-2000:]
    [line] = out.stderr.splitlines()
    assert line.startswith(f"gateway {process}: configuration error: a gateway Celery app needs REDIS_URL")


@pytest.mark.parametrize("process", ["worker", "beat"])
def test_worker_and_beat_with_a_bad_config_file(process, closed_port, bad_toml, tmp_path):
    argv = WORKER if process == "worker" else ("-A", "beat.app", "beat", "-s", str(tmp_path / "schedule"))
    url = f"redis://127.0.0.1:{closed_port}/0"
    missing = str(tmp_path / "nope.toml")
    for config, expected in ((missing, f"GATEWAY_CONFIG={missing!r}: file not found"),
                             (bad_toml, "settings: policy='fifo-ish' is invalid")):
        out = celery(*argv, env=_env(REDIS_URL=url, GATEWAY_CONFIG=config))
        assert out.returncode == EXIT_CONFIG, out.stderr[-2000:]
        [line] = out.stderr.splitlines()
        assert line.startswith(f"gateway {process}: configuration error: ") and expected in line, line
        assert out.stdout == ""


def test_a_worker_for_an_unknown_tier_stops_before_it_consumes(closed_port):
    """-Q gt.gold.default: the worker stops at start with the one critical line (it never
    gets to connect: the Redis here is a closed port, so a worker that went on would hang)."""
    out = celery(*WORKER, "-Q", "gt.gold.default",
                 env=_env(REDIS_URL=f"redis://127.0.0.1:{closed_port}/0"))
    assert out.returncode == EXIT_CONFIG, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "Unrecoverable error" not in text and "[queues]" not in text
    [line] = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert line.endswith("CRITICAL/MainProcess] gateway worker: configuration error: unknown tier 'gold'; "
                         "known tiers: vip, normal, batch"), line


def test_flower_without_redis_url():
    out = celery("-A", "gateway_tasks.cli.flower", "flower", "--port=0", env=_env())
    assert out.returncode == EXIT_CONFIG, out.stderr[-2000:]
    [line] = out.stderr.splitlines()
    assert line.startswith("gateway flower: configuration error: a gateway Celery app needs REDIS_URL")


# -- the one mechanism, in process ------------------------------------------------------
def test_redis_full_and_refused_credentials_are_one_line(monkeypatch, capsys):
    url = f"redis://u:{SECRET}@127.0.0.1:7777/0"
    monkeypatch.setenv("REDIS_URL", url)
    monkeypatch.delenv("GATEWAY_CONFIG", raising=False)

    def full(_args):
        raise redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")

    def refused(_args):
        raise redis.AuthenticationError("invalid username-password pair or user is disabled.")

    from gateway_tasks.core.settings import get_settings
    get_settings.cache_clear()
    try:
        assert run_command(full, SimpleNamespace()) == EXIT_REDIS_UNAVAILABLE
        assert run_command(refused, SimpleNamespace()) == EXIT_REDIS_UNAVAILABLE
    finally:
        get_settings.cache_clear()
    captured = capsys.readouterr()
    assert captured.out == "" and SECRET not in captured.err
    assert captured.err.splitlines() == [
        "gateway: Redis at redis://127.0.0.1:7777/0 is full (at its maxmemory); free memory or raise "
        "its maxmemory, with maxmemory-policy noeviction",
        "gateway: Redis at redis://127.0.0.1:7777/0 refused the credentials (authentication failed); "
        "check REDIS_URL, REDIS_USERNAME and REDIS_PASSWORD"]


def test_a_redis_error_that_is_not_an_outage_is_not_hidden():
    def bug(_args):
        raise redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    with pytest.raises(redis.ResponseError):
        run_command(bug, SimpleNamespace())


def test_causes_in_words():
    refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert cause_of(refused) == "connection refused"
    assert cause_of(redis.TimeoutError("Timeout connecting to server")) == "timed out"
    wrapped = redis.ResponseError("ERR Error running script: -OOM command not allowed when used "
                                  "memory > 'maxmemory'.")
    assert isinstance(as_unavailable(wrapped), RedisFull)
    down = as_unavailable(refused, "submit", "nothing was enqueued")
    assert type(down) is RedisUnavailable and str(down).endswith("; nothing was enqueued")
    assert unavailable_line(down, f"rediss://:{SECRET}@h:6380/0?password={SECRET}") == \
        "Redis at rediss://h:6380/0 is unreachable (connection refused); check REDIS_URL"


# -- REST: 503 in the gateway's words ----------------------------------------------------
def _assert_gateways_words(resp, message: str, port: int, prefix: str) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["Retry-After"] == "1"
    assert resp.json()["error"]["message"] == message
    for word in (str(port), prefix, *REDIS_WORDS):
        assert word not in resp.text, (word, resp.text)


@pytest.fixture
def private_gateway():
    """A Gateway on its own Redis (stopped or filled by the test), a tenant, its Tenant."""
    prefix = f"gt-503-{uuid.uuid4().hex[:8]}:"
    pool = Pool("default", base_url="http://127.0.0.1:9/v1", api_key="k", models=("gpt-4o-mini",),
                tpm=120_000, rpm=6_000)
    with EmbeddedRedis() as server:
        settings = load_settings(env={"REDIS_URL": server.plain_url, "GATEWAY_KEY_PREFIX": prefix},
                                 pools=(pool,))
        gw = Gateway(settings)
        try:
            key = gw.register_tenant("acme", "vip")
            yield SimpleNamespace(server=server, gw=gw, key=key, tenant=gw.tenants.authenticate(key),
                                  prefix=prefix)
        finally:
            gw.app.close()


def test_rest_503_with_redis_stopped_names_nothing_of_it(private_gateway, monkeypatch, caplog):
    p = private_gateway
    port = p.server.port
    down = "the gateway's Redis is unreachable; retry later"
    hello = [{"role": "user", "content": "hello"}]
    with TestClient(create_app(p.gw)) as client:
        auth = {"Authorization": f"Bearer {p.key}"}
        p.server.stop()
        # authentication itself needs Redis
        _assert_gateways_words(client.post("/v1/tasks", json={"messages": hello}, headers=auth),
                               down, port, p.prefix)
        # past authentication: submit, crons, cancel
        monkeypatch.setattr(p.gw.tenants, "authenticate", lambda api_key: p.tenant)
        with caplog.at_level("WARNING", logger="gateway_tasks.rest.errors"):
            _assert_gateways_words(client.post("/v1/tasks", json={"messages": hello}, headers=auth),
                                   down, port, p.prefix)
            _assert_gateways_words(client.post("/v1/chat/completions", json={"messages": hello},
                                               headers=auth), down, port, p.prefix)
            _assert_gateways_words(client.post("/v1/crons", json={"task_id": "digest", "cron": "0 * * * *",
                                                                  "messages": "hi"}, headers=auth),
                                   down, port, p.prefix)
            _assert_gateways_words(client.get("/v1/crons", headers=auth), down, port, p.prefix)
            _assert_gateways_words(client.get("/v1/status", headers=auth), down, port, p.prefix)
    # the detail is the server's: in its log
    assert any(str(port) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_rest_503_with_redis_full_says_full(private_gateway, monkeypatch):
    p = private_gateway
    full = "the gateway's Redis is full; retry later"
    admin = redis.Redis.from_url(p.server.plain_url)
    with TestClient(create_app(p.gw)) as client:
        auth = {"Authorization": f"Bearer {p.key}"}
        admin.config_set("maxmemory", 1)      # every write is refused (noeviction)
        try:
            resp = client.post("/v1/crons", json={"task_id": "digest", "cron": "0 * * * *", "messages": "hi"},
                               headers=auth)
            _assert_gateways_words(resp, full, p.server.port, p.prefix)
            resp = client.post("/v1/tasks", json={"messages": [{"role": "user", "content": "hello"}]},
                               headers=auth)
            _assert_gateways_words(resp, full, p.server.port, p.prefix)
            assert resp.json()["error"]["type"] == "RedisFull"
        finally:
            admin.config_set("maxmemory", 0)
            admin.close()


def test_a_stream_that_loses_redis_ends_with_one_error_event():
    class Down:
        def xread(self, *args, **kwargs):
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

        def delete(self, *keys):
            raise AssertionError("an unfinished stream is left alone")

    fake = SimpleNamespace(r=Down(), keys=Keys("gt-stream:"))

    async def collect() -> list[str]:
        return [e async for e in events(fake, "t1", False, first_timeout_s=5, idle_timeout_s=5)]

    [event] = asyncio.run(collect())
    assert event.startswith("data: ") and '"type":"ServiceUnavailable"' in event
    assert "the gateway's Redis is unreachable; retry later" in event and "6399" not in event


def test_a_stream_whose_result_backend_gives_up_or_whose_cleanup_fails_still_ends_cleanly():
    """The other reads a stream makes: the result backend's (which raises BackendGetMetaError
    once its retries are spent) ends in the same ServiceUnavailable event; a Redis failure
    while deleting a finished stream's chunks does not cut the stream after [DONE]."""
    refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

    class Quiet:
        def xread(self, *args, **kwargs):
            return []

    class Backend:
        def get_task_meta(self, task_id):
            raise BackendGetMetaError("failed to get meta", task_id=task_id) from refused

    class Done:
        def xread(self, *args, **kwargs):
            return [[b"gt-stream:chunks:t1", [(b"1-0", {b"kind": b"done", b"data": b"{}"})]]]

        def delete(self, *keys):
            raise refused

    async def collect(fake) -> list[str]:
        return [e async for e in events(fake, "t1", False, first_timeout_s=5, idle_timeout_s=5)]

    down = SimpleNamespace(r=Quiet(), keys=Keys("gt-stream:"), app=SimpleNamespace(backend=Backend()))
    [event] = asyncio.run(collect(down))
    assert '"type":"ServiceUnavailable"' in event and "6399" not in event
    done = SimpleNamespace(r=Done(), keys=Keys("gt-stream:"))
    assert asyncio.run(collect(done)) == ["data: [DONE]\n\n"]
