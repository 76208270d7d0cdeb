"""Redis AUTH / ACL and TLS: settings that keep the password out of the URL, and a
whole deployment (producer, REST API, a real worker process) against a real
redis-server that requires an ACL user restricted to the deployment's keys, and
against one that speaks TLS only."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gateway_tasks.core.errors import RedisUnavailable
import redis
from fastapi.testclient import TestClient

from gateway_tasks.core.errors import ConfigError, StartupError
from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, load_settings, settings_to_json
from devtools import processes
from gateway_tasks.local.redis_server import EmbeddedRedis, bundled_redis_server
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app

PASSWORD = "s3cret/pa:ss@word-" + uuid.uuid4().hex[:8]
HELLO = [{"role": "user", "content": "hello over an authenticated connection"}]


# -- settings ---------------------------------------------------------------------------
def test_password_and_acl_user_from_the_environment_join_the_url():
    s = load_settings(env={"REDIS_URL": "redis://redis.example:6379/0", "REDIS_USERNAME": "gateway",
                           "REDIS_PASSWORD": PASSWORD})
    parsed = redis.connection.parse_url(s.redis_url)
    assert (parsed["username"], parsed["password"]) == ("gateway", PASSWORD)
    assert PASSWORD not in repr(s)
    public = s.public()
    for shown in (public.redis_url, settings_to_json(public)):
        assert PASSWORD not in shown and "s3cret" not in shown
    assert public.redis_url == "redis://redis.example:6379/0"
    # a URL that carries its own credentials keeps them
    own = load_settings(env={"REDIS_URL": "redis://:mine@h:1/0", "REDIS_PASSWORD": PASSWORD})
    assert redis.connection.parse_url(own.redis_url)["password"] == "mine"


def test_rediss_urls_verify_the_server_by_default():
    s = load_settings(env={"REDIS_URL": "rediss://redis.example:6380/0",
                           "REDIS_TLS_CA_FILE": "/etc/redis-ca/ca.crt"})
    parsed = redis.connection.parse_url(s.redis_url)
    assert parsed["ssl_cert_reqs"] == "required" and parsed["ssl_ca_certs"] == "/etc/redis-ca/ca.crt"
    assert parsed["connection_class"] is redis.SSLConnection


@pytest.mark.parametrize("env,fragment", [
    ({"REDIS_URL": "redis://h:1/0", "REDIS_TLS_CA_FILE": "/ca.crt"}, "not rediss://"),
    ({"REDIS_URL": "redis://h:1/0", "REDIS_USERNAME": "gateway"}, "without redis_password"),
    ({"REDIS_URL": "http://h:1/0", "REDIS_PASSWORD": PASSWORD}, "redis://, rediss://"),
    ({"REDIS_URL": "rediss://h:1/0", "REDIS_TLS_CERT_REQS": "maybe"}, "redis_tls_cert_reqs"),
])
def test_bad_redis_security_settings_fail_fast_without_the_password(env, fragment):
    with pytest.raises(ConfigError) as err:
        load_settings(env=env)
    assert fragment in str(err.value) and PASSWORD not in str(err.value)


# -- a real ACL-protected server ----------------------------------------------------------
def manifest_acl_rules(key_prefix: str) -> str:
    """The gateway user's ACL rules in deploy/k8s/base/redis.yaml, its key pattern set to key_prefix."""
    yaml = pytest.importorskip("yaml")
    docs = yaml.safe_load_all((Path(__file__).resolve().parent.parent / "deploy/k8s/base/redis.yaml").read_text())
    [redis_set] = [d for d in docs if d and d["kind"] == "StatefulSet"]
    args = redis_set["spec"]["template"]["spec"]["containers"][0]["args"]
    users = [i for i, a in enumerate(args) if a == "--user"]
    rules = args[users[-1] + 4:]
    assert any(r.startswith("~") for r in rules) and "-@dangerous" in rules
    return " ".join(f"~{key_prefix}*" if r.startswith("~") else r for r in rules)


def _deployment_settings(server: EmbeddedRedis, prefix: str, sim, **env):
    pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",), tpm=120_000,
                rpm=6_000)
    return load_settings(env={"REDIS_URL": server.plain_url, "GATEWAY_KEY_PREFIX": prefix, **env},
                         pools=(pool,))


@pytest.mark.slow
def test_a_deployment_runs_as_an_acl_user_limited_to_its_keys(tmp_path):
    prefix = f"gt-acl-{uuid.uuid4().hex[:8]}:"
    # the ACL rules of deploy/k8s/base/redis.yaml, keys moved to this test's prefix: its keys only,
    # Pub/Sub, and no admin or dangerous command
    rules = manifest_acl_rules(prefix)
    with SimulatorThread(SimConfig(tpm=120_000, rpm=6_000, base_latency_ms=2)) as sim, \
            EmbeddedRedis(username="gateway", password=PASSWORD, acl_rules=rules) as server:
        anonymous = redis.Redis.from_url(server.plain_url)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        settings = _deployment_settings(server, prefix, sim, REDIS_USERNAME="gateway",
                                        REDIS_PASSWORD=PASSWORD)
        gw = Gateway(settings)
        log = tmp_path / "worker.log"
        worker = processes.worker(settings, concurrency=2, log_path=str(log), loglevel="info").start()
        beat_log = tmp_path / "beat.log"
        beat = processes.Child([sys.executable, "-m", "celery", "-A", "beat.app", "beat", "-l", "info",
                                "-s", str(tmp_path / "beat-schedule")], processes.child_env(settings),
                               str(beat_log)).start()
        try:
            key = gw.register_tenant("acme", "vip")
            processes.wait_for_workers(gw.app, 1)
            handle = gw.submit("acme", HELLO, max_tokens=16)
            assert handle.get(timeout=60)["response"]["choices"][0]["message"]["role"] == "assistant"
            with TestClient(create_app(gw)) as client:
                assert client.get("/healthz").json() == {"status": "ok"}
                resp = client.post("/v1/tasks", json={"messages": HELLO}, headers={
                    "Authorization": f"Bearer {key}"})
                assert resp.status_code == 202, resp.text
                task_id = resp.json()["task_id"]
                assert gw.result(task_id).get(timeout=60)["tenant_id"] == "acme"
            # the user really is confined to the prefix
            own = redis.Redis.from_url(settings.redis_url)
            # beat, too, works as this user: it takes its leader lock and ticks
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not own.exists(Keys(prefix).beat_lock):
                time.sleep(0.2)
            assert own.exists(Keys(prefix).beat_lock), beat_log.read_text()[-2000:]
            assert beat.alive() and "Redis error" not in beat_log.read_text()
            with pytest.raises(redis.exceptions.NoPermissionError):
                own.set("not-my-prefix", 1)
            with pytest.raises(redis.exceptions.NoPermissionError):
                own.flushall()
        finally:
            beat.stop()
            worker.stop()
            gw.app.close()
    assert PASSWORD not in log.read_text() and PASSWORD not in beat_log.read_text()


def test_a_wrong_redis_password_is_a_clear_error_that_never_shows_it(tmp_path):
    with SimulatorThread(SimConfig()) as sim, EmbeddedRedis(password=PASSWORD) as server:
        wrong = "wrong-password-" + uuid.uuid4().hex[:6]
        settings = _deployment_settings(server, "gt-acl-x:", sim, REDIS_PASSWORD=wrong)
        gw = Gateway(settings)
        try:
            with pytest.raises(RedisUnavailable, match="AuthenticationError") as err:
                gw.submit("acme", HELLO)   # the producer's own error, the cause named, no password
            assert wrong not in str(err.value)
            with TestClient(create_app(gw)) as client:
                resp = client.post("/v1/tasks", json={"messages": HELLO},
                                   headers={"Authorization": "Bearer gt-anything-at-all"})
                assert resp.status_code == 503 and resp.json()["error"]["type"] == "ServiceUnavailable"
                assert wrong not in resp.text
                health = client.get("/healthz")
                assert health.status_code == 503 and wrong not in health.text
            out = subprocess.run(["gateway", "ready", "--timeout-s", "1"], capture_output=True, text=True,
                                 env=processes.child_env(settings), timeout=60,
                                 executable=shutil.which("gateway", path=_venv_bin()))
            assert out.returncode != 0
            assert wrong not in out.stdout + out.stderr and "Redis" in out.stdout + out.stderr
        finally:
            gw.app.close()


def _venv_bin() -> str:
    import os
    import sys
    return os.path.dirname(sys.executable)


# -- TLS ------------------------------------------------------------------------------
def _certificates(folder) -> dict[str, str]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl)."""
    openssl = shutil.which("openssl")
    if not openssl:
        pytest.skip("openssl is needed to make test certificates")
    f = {n: str(folder / n) for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt",
                                      "san.ext", "other.key", "other.crt")}
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f["ca.key"], "-out", f["ca.crt"],
        "-days", "1", "-subj", "/CN=gateway-tasks test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f["server.key"], "-out", f["server.csr"],
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", f["server.csr"], "-CA", f["ca.crt"], "-CAkey", f["ca.key"],
        "-CAcreateserial", "-out", f["server.crt"], "-days", "1", "-extfile", f["san.ext"])
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f["other.key"], "-out", f["other.crt"],
        "-days", "1", "-subj", "/CN=some other CA")
    return f


def _tls_server(certs: dict[str, str]) -> EmbeddedRedis:
    binary = shutil.which("redis-server") or bundled_redis_server()
    server = EmbeddedRedis(binary=binary, password=PASSWORD, tls_cert_file=certs["server.crt"],
                           tls_key_file=certs["server.key"], tls_ca_file=certs["ca.crt"])
    try:
        return server.start()
    except StartupError as exc:
        pytest.skip(f"this redis-server has no TLS support ({binary}): {str(exc)[:120]}")


@pytest.mark.slow
def test_a_deployment_runs_over_tls(tmp_path):
    certs = _certificates(tmp_path)
    prefix = f"gt-tls-{uuid.uuid4().hex[:8]}:"
    server = _tls_server(certs)
    try:
        with SimulatorThread(SimConfig(tpm=120_000, rpm=6_000, base_latency_ms=2)) as sim:
            settings = _deployment_settings(server, prefix, sim, REDIS_PASSWORD=PASSWORD,
                                            REDIS_TLS_CA_FILE=certs["ca.crt"])
            assert settings.redis_url.startswith("rediss://")
            # plain TCP to the TLS port, and TLS that trusts another CA, both fail
            with pytest.raises(redis.ConnectionError):
                redis.Redis.from_url(server.plain_url.replace("rediss://", "redis://"),
                                     socket_timeout=2).ping()
            other_ca = settings.with_(redis_url=server.plain_url, redis_tls_ca_file=certs["other.crt"])
            with pytest.raises(redis.ConnectionError):
                redis.Redis.from_url(other_ca.redis_url, socket_timeout=2).ping()
            gw = Gateway(settings)
            worker = processes.worker(settings, concurrency=2, log_path=str(tmp_path / "w.log")).start()
            try:
                gw.register_tenant("acme", "vip")
                processes.wait_for_workers(gw.app, 1)
                res = gw.submit("acme", HELLO, max_tokens=16).get(timeout=60)
                assert res["response"]["choices"][0]["message"]["role"] == "assistant"
            finally:
                worker.stop()
                gw.app.close()
    finally:
        server.stop()
