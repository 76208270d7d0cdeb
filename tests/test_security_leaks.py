"""Secrets and tenants' data never leak: a real deployment -- a password-protected
Redis, the upstream simulator, a worker, the REST API as its own process and
Flower -- runs requests carrying a planted tenant API key and a planted prompt,
the upstream answers a planted completion, and every captured output is grepped:
the worker's, the API's and Flower's logs, Prometheus metrics, every Flower page
and API answer, every `inspect` reply (one taken while a task runs), and the
error answers of bad requests.  Only the owner's own result shows the completion.
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import httpx
import pytest

from gateway_tasks.cli import flower as flower_cli
from gateway_tasks.core.settings import Pool, load_settings
from devtools import processes
from gateway_tasks.local.ports import free_port
from gateway_tasks.local.redis_server import EmbeddedRedis
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from workers.redaction import RESULT_HIDDEN

pytestmark = pytest.mark.slow

LOGLEVEL = "debug"   # the most verbose level: a superset of what production logs
MARK = uuid.uuid4().hex[:10]
TENANT_KEY = f"gt-PLANTEDKEY{MARK}"
PROMPT_MARK = f"PLANTEDPROMPT{MARK}"
COMPLETION_MARK = f"PLANTEDCOMPLETION{MARK}"
UPSTREAM_KEY = f"sk-PLANTEDUPSTREAM{MARK}"
ADMIN_KEY = f"PLANTEDADMIN{MARK}xxxxxx"
API_KEY_SECRET = f"PLANTEDHMAC{MARK}xxxxxxx"
REDIS_PASSWORD = f"PLANTEDREDIS{MARK}"
SECRETS = (TENANT_KEY, PROMPT_MARK, COMPLETION_MARK, UPSTREAM_KEY, ADMIN_KEY, API_KEY_SECRET,
           REDIS_PASSWORD)
PROMPT = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": f"Summarise the secret plan {PROMPT_MARK} in one line"}]


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


def poll_task(api: httpx.Client, task_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = api.get(f"/v1/tasks/{task_id}").json()
        if body["status"] in ("SUCCESS", "FAILURE"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"task {task_id} did not finish")


def test_keys_prompts_and_completions_never_leak(tmp_path):
    outputs: dict[str, str] = {}
    prefix = f"gt-leak-{MARK}:"
    with EmbeddedRedis(password=REDIS_PASSWORD) as server, \
            SimulatorThread(SimConfig(reply_text=f"The plan: {COMPLETION_MARK}.", base_latency_ms=1500)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key=UPSTREAM_KEY, models=("gpt-4o-mini",),
                    tpm=600_000, rpm=6_000)
        settings = load_settings(env={"REDIS_URL": server.plain_url, "REDIS_PASSWORD": REDIS_PASSWORD,
                                      "GATEWAY_ADMIN_KEY": ADMIN_KEY, "GATEWAY_API_KEY_SECRET": API_KEY_SECRET,
                                      "GATEWAY_KEY_PREFIX": prefix}, pools=(pool,))
        gw = Gateway(settings)
        gw.register_tenant("acme", "vip", api_key=TENANT_KEY)
        api_port, flower_port = free_port(), free_port()
        logs = {name: tmp_path / f"{name}.log" for name in ("worker", "api", "flower")}
        worker = processes.worker(settings, concurrency=4, log_path=str(logs["worker"]), loglevel=LOGLEVEL)
        api_proc = processes.api(processes.child_env(settings), port=api_port, log_path=str(logs["api"]))
        basic = flower_cli.generated_basic_auth()
        flower = processes.flower(settings, port=flower_port, basic_auth=basic, log_path=str(logs["flower"]))
        for child in (worker, api_proc, flower):
            child.start()
        base = f"http://127.0.0.1:{api_port}"
        try:
            processes.wait_for_workers(gw.app, 1)
            wait_http(base + "/healthz")
            api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TENANT_KEY}"}, timeout=90)
            # -- the owner's own traffic: async submit + poll, and the synchronous endpoint
            resp = api.post("/v1/tasks", json={"messages": PROMPT, "max_tokens": 16})
            assert resp.status_code == 202, resp.text
            first = resp.json()["task_id"]
            # inspect while it runs (the upstream holds each call 1.5 s)
            inspect = gw.app.control.inspect(timeout=1.0)
            deadline = time.monotonic() + 30
            active = inspect.active() or {}
            while time.monotonic() < deadline and not any(active.values()):
                active = inspect.active() or {}
            live = {"active": active, "reserved": inspect.reserved(), "stats": inspect.stats(),
                    "conf": inspect.conf(with_defaults=True), "query": inspect.query_task(first)}
            outputs["inspect while running"] = json.dumps(live, default=str)
            running = [t for tasks in (live["active"] or {}).values() for t in tasks]
            assert [t["id"] for t in running] == [first], live["active"]   # caught it in flight
            assert "tenant=acme" in str(running[0]["args"])                # the summary instead
            done = poll_task(api, first)
            assert done["status"] == "SUCCESS" and COMPLETION_MARK in json.dumps(done)  # the owner sees it
            assert "args" not in done and PROMPT_MARK not in json.dumps(done)
            sync = api.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 16})
            assert sync.status_code == 200 and COMPLETION_MARK in sync.text
            ids = [first, sync.headers["X-Gateway-Task-Id"]]
            # -- errors: none echoes the prompt or a key
            bad = {
                "bad role": api.post("/v1/tasks", json={"messages": [{"role": "robot", "content": PROMPT_MARK}]}),
                "extra field": api.post("/v1/tasks", json={"messages": PROMPT, "temperature": PROMPT_MARK}),
                "too large": api.post("/v1/tasks", json={"messages": PROMPT, "max_tokens": 10_000_000}),
                "bad json": api.post("/v1/tasks", content=f'{{"messages": "{PROMPT_MARK}'.encode(),
                                     headers={"Content-Type": "application/json"}),
                "upstream rejects": api.post("/v1/chat/completions",
                                             json={"messages": PROMPT, "n": 3, "max_tokens": 8}),
                "wrong key": httpx.post(base + "/v1/tasks", json={"messages": PROMPT},
                                        headers={"Authorization": f"Bearer {TENANT_KEY}x"}),
                "admin with tenant key": api.get("/v1/admin/settings"),
            }
            for name, r in bad.items():
                assert r.status_code >= 400, (name, r.text)
                outputs[f"error answer: {name}"] = r.text
            ids.append(bad["upstream rejects"].headers.get("X-Gateway-Task-Id", ""))
            # -- operators' views
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            outputs["/metrics"] = httpx.get(base + "/metrics", headers=admin).text
            assert "gateway_queue_depth_messages" in outputs["/metrics"]
            outputs["/v1/admin/settings"] = httpx.get(base + "/v1/admin/settings", headers=admin).text
            outputs["/v1/admin/tenants"] = httpx.get(base + "/v1/admin/tenants", headers=admin).text
            assert "acme" in outputs["/v1/admin/tenants"]
            metrics_cli = processes.subprocess.run(
                [sys.executable, "-m", "gateway_tasks.cli", "metrics"], env=processes.child_env(settings),
                capture_output=True, text=True, timeout=60)
            outputs["gateway metrics"] = metrics_cli.stdout + metrics_cli.stderr
            inspect = gw.app.control.inspect(timeout=1.0)
            outputs["inspect after"] = json.dumps({
                "stats": inspect.stats(), "conf": inspect.conf(with_defaults=True),
                "registered": inspect.registered(), "report": inspect.report(),
                "query": inspect.query_task(*[i for i in ids if i])}, default=str)
            # -- Flower: every page and API answer, behind its basic auth
            user, password = flower_cli.first_credentials(basic)
            fbase = f"http://127.0.0.1:{flower_port}"
            with httpx.Client(base_url=fbase, auth=(user, password), timeout=10) as fl:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        tasks = fl.get("/api/tasks").json()
                        if all(i in tasks and tasks[i].get("state") in ("SUCCESS", "FAILURE")
                               for i in ids if i):
                            break
                    except (httpx.HTTPError, ValueError):
                        pass
                    time.sleep(0.5)
                else:
                    raise AssertionError("Flower never saw the tasks finish")
                assert tasks[first]["result"] == repr(RESULT_HIDDEN) or \
                    RESULT_HIDDEN in str(tasks[first]["result"])
                workers = fl.get("/api/workers?refresh=1").json()
                paths = ["/", "/workers", "/tasks", "/broker", "/api/tasks", "/api/workers?refresh=1",
                         "/api/task/types", "/api/queues/length", "/metrics"]
                paths += [f"/worker/{w}" for w in workers]
                paths += [f"/task/{i}" for i in ids if i] + [f"/api/task/info/{i}" for i in ids if i]
                for path in paths:
                    r = fl.get(path)
                    assert r.status_code == 200, (path, r.status_code)
                    outputs[f"flower {path}"] = r.text
                for i in ids:
                    if i:
                        assert fl.get(f"/api/task/result/{i}").status_code == 503   # no backend
        finally:
            for child in (flower, api_proc, worker):
                child.stop()
            gw.app.close()
    for name, path in logs.items():
        outputs[f"{name} log"] = path.read_text(errors="replace")
    assert "succeeded in" in outputs["worker log"] and "POST /v1/tasks" in outputs["api log"]
    leaks = [(secret, where) for where, text in outputs.items() for secret in SECRETS if secret in text]
    for secret, where in leaks:
        text = outputs[where]
        i = text.index(secret)
        print(where, "...", text[max(0, i - 400):i + 100])
    assert not leaks, leaks
