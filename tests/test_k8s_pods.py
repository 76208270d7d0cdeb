"""The pods of deploy/k8s as real processes: a Celery worker and the REST API, each started
with the command and the environment its Deployment gives it -- env and envFrom resolved
from the ConfigMap and the Secrets (test values in place of the placeholders), the
ConfigMap's gateway.toml written where the pod mounts it -- against a redis-server with the
manifest's ACL user and memory settings and the upstream simulator (`gateway
simulate-upstream`) in place of the provider.  A tenant registered through the admin API
completes a /v1/chat/completions call: the API loads the pools without the upstream key,
which only the worker has."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools import processes
from gateway_tasks.local.ports import free_port
from gateway_tasks.local.redis_server import EmbeddedRedis
from tests.test_k8s_manifests import UPSTREAM_SECRET, arg_after, one, pod_env, secret_data

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
PROVIDER_URL = "https://api.openai.com/v1"
HELLO = [{"role": "user", "content": "hello from the pods of deploy/k8s"}]


def _container(kind: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    workload = one(kind, name)
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return workload, c


def _redis_server(password: str) -> EmbeddedRedis:
    """A redis-server run as redis.yaml runs Redis: its ACL user and rules, maxmemory, policy."""
    _, c = _container("StatefulSet", "redis")
    args = c["args"]
    users = [i for i, a in enumerate(args) if a == "--user"]
    user = args[users[-1] + 1]
    assert args[users[-1] + 2:users[-1] + 4] == ["on", ">$(REDIS_PASSWORD)"]
    rules = " ".join(args[users[-1] + 4:])
    memory = ("--maxmemory", arg_after(args, "--maxmemory"),
              "--maxmemory-policy", arg_after(args, "--maxmemory-policy"))
    return EmbeddedRedis(username=user, password=password, acl_rules=rules, extra_args=memory)


def _secrets() -> dict[str, dict[str, str]]:
    """Test values for every key of every Secret of the manifests."""
    out: dict[str, dict[str, str]] = {}
    for doc in [one("Secret", n) for n in ("gateway-upstream", "gateway-redis", "gateway-api",
                                           "gateway-flower")]:
        name = doc["metadata"]["name"]
        out[name] = {key: f"test-{key.lower()}-{uuid.uuid4().hex}" for key in secret_data(name)}
    out["gateway-flower"]["FLOWER_BASIC_AUTH"] = f"admin:{uuid.uuid4().hex}"
    return out


def _process_env(pod: dict[str, str], root: Path) -> dict[str, str]:
    """A pod's environment and what any container has (PATH, HOME); nothing of this
    test's own environment, so no GATEWAY_* or REDIS_* variable slips in."""
    return {"PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(root),
            "LANG": "C.UTF-8", **pod}


def _wait(check, what: str, children: list[processes.Child], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if not child.alive():
                raise AssertionError(f"{child.argv[:4]} exited while waiting for {what}:\n"
                                     + Path(child.log_path).read_text()[-3000:])
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.3)
    logs = "\n".join(f"--- {c.argv[:4]}\n{Path(c.log_path).read_text()[-2000:]}" for c in children)
    raise AssertionError(f"no {what} within {timeout_s}s\n{logs}")


def test_a_worker_and_the_api_with_their_pods_environments_complete_a_chat_completion(tmp_path):
    secrets = _secrets()
    upstream_key = secrets[UPSTREAM_SECRET]["OPENAI_API_KEY"]
    sim_port, api_port = free_port(), free_port()
    sim_url = f"http://127.0.0.1:{sim_port}/v1"
    toml = one("ConfigMap", "gateway-config")["data"]["gateway.toml"]
    assert PROVIDER_URL in toml
    children: list[processes.Child] = []
    with _redis_server(secrets["gateway-redis"]["REDIS_PASSWORD"]) as server:
        config = {"REDIS_URL": server.plain_url, "gateway.toml": toml.replace(PROVIDER_URL, sim_url)}
        pods = {}
        for name in ("gateway-worker-vip", "gateway-api"):
            workload, c = _container("Deployment", name)
            env = pod_env(workload, c, tmp_path / name, secrets=secrets, config=config)
            pods[name] = (c, _process_env(env, tmp_path / name))
        worker_c, worker_env = pods["gateway-worker-vip"]
        api_c, api_env = pods["gateway-api"]
        # what the manifests give each: the key to the worker, the admin secrets to the API
        assert worker_env["OPENAI_API_KEY"] == upstream_key
        assert upstream_key not in api_env.values()
        assert "GATEWAY_ADMIN_KEY" in api_env and "GATEWAY_ADMIN_KEY" not in worker_env

        sim = processes.Child([str(BIN / "gateway"), "simulate-upstream", "--port", str(sim_port),
                               "--tpm", "600000", "--rpm", "6000", "--base-latency-ms", "5"],
                              _process_env({}, tmp_path), str(tmp_path / "sim.log"))
        # the worker pod's command, with fewer threads; its node name is the pod's host name
        # (celery@$HOSTNAME, as its readiness probe asks for)
        worker_env["HOSTNAME"] = f"gateway-worker-vip-{uuid.uuid4().hex[:8]}"
        argv = list(worker_c["command"])
        argv[argv.index("-c") + 1] = "4"
        argv = [str(BIN / argv[0]), *argv[1:], "-n", f"celery@{worker_env['HOSTNAME']}"]
        worker = processes.Child(argv, worker_env, str(tmp_path / "worker.log"))
        argv = list(api_c["command"])
        argv[argv.index("--host") + 1] = "127.0.0.1"
        argv[argv.index("--port") + 1] = str(api_port)
        api = processes.Child([str(BIN / argv[0]), *argv[1:]], api_env, str(tmp_path / "api.log"))
        try:
            for child in (sim, worker, api):
                children.append(child.start())
            _wait(lambda: httpx.get(f"{sim_url}/models", timeout=2).status_code == 200, "simulator",
                  children)
            base = f"http://127.0.0.1:{api_port}"
            probe = api_c["readinessProbe"]["httpGet"]["path"]
            _wait(lambda: httpx.get(base + probe, timeout=2).status_code == 200, "API readiness", children)
            # the worker pod's readiness probe, as the kubelet runs it in the pod
            probe = worker_c["readinessProbe"]["exec"]["command"]
            _wait(lambda: subprocess.run(probe, env=worker_env, capture_output=True,
                                         timeout=30).returncode == 0, "worker readiness", children)

            admin = {"Authorization": f"Bearer {secrets['gateway-api']['GATEWAY_ADMIN_KEY']}"}
            resp = httpx.post(f"{base}/v1/admin/tenants", json={"tenant_id": "acme", "tier": "vip"},
                              headers=admin, timeout=10)
            assert resp.status_code == 201, resp.text
            key = resp.json()["api_key"]
            resp = httpx.post(f"{base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 16},
                              headers={"Authorization": f"Bearer {key}"}, timeout=90)
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        finally:
            for child in reversed(children):
                child.stop()
    for log in ("worker.log", "api.log"):
        text = (tmp_path / log).read_text()
        assert upstream_key not in text and secrets["gateway-redis"]["REDIS_PASSWORD"] not in text
