"""Flower sees the gateway's workers and tasks (events on, JSON only), behind basic
auth, and no page of it -- nor any worker's `inspect` reply -- shows an API key."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from gateway_tasks.cli import flower as flower_cli
from devtools import processes
from gateway_tasks.local.ports import free_port
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.core.settings import Pool

pytestmark = pytest.mark.slow

PLANTED_KEY = "sk-planted-0123456789abcdefSECRET"   # only ever in the second worker's environment
OWN_KEY = "sk-very-secret-own-key"


def inspect_replies(app) -> dict[str, object]:
    """Every read-only `celery inspect` reply of every worker."""
    inspect = app.control.inspect(timeout=2.0)
    replies = {}
    for name in ("stats", "conf", "registered", "active_queues", "report", "active", "reserved",
                 "scheduled", "revoked", "ping"):
        method = getattr(inspect, name)
        replies[name] = method(with_defaults=True) if name == "conf" else method()
    return replies


def test_flower_pages_and_inspect_never_show_an_api_key(settings, r, tmp_path):
    with SimulatorThread(SimConfig(base_latency_ms=1)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key=OWN_KEY, models=("gpt-4o-mini",),
                    tpm=600_000, rpm=6_000)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        planted_pools = json.dumps([{"name": "default", "base_url": sim.base_url, "api_key": PLANTED_KEY,
                                     "models": ["gpt-4o-mini"], "tpm": 600_000, "rpm": 6_000}])
        port = free_port()
        auth = flower_cli.generated_basic_auth()
        user, password = auth.split(":", 1)
        w1 = processes.worker(s, concurrency=2, name="w1", log_path=str(tmp_path / "w1.log"))
        w2 = processes.worker(s, concurrency=2, name="w2", log_path=str(tmp_path / "w2.log"))
        w2.env["GATEWAY_POOLS_JSON"] = planted_pools
        flower = processes.flower(s, port=port, basic_auth=auth, log_path=str(tmp_path / "f.log"))
        w1.start(), w2.start(), flower.start()
        base = f"http://127.0.0.1:{port}"
        try:
            processes.wait_for_workers(gw.app, 2)
            handles = [gw.submit("acme", f"hello number {i}", max_tokens=5) for i in range(6)]
            for h in handles:
                h.get(timeout=30)
            with httpx.Client(auth=(user, password)) as client:
                # no auth, no Flower: pages, API, /metrics and /healthcheck alike
                for path in ("/", "/workers", "/tasks", "/broker", "/api/workers", "/api/tasks",
                             "/metrics", "/healthcheck"):
                    assert httpx.get(base + path, timeout=5).status_code == 401, path
                tasks = processes.poll_json(client, f"{base}/api/tasks",
                                            lambda body: all(h.id in body for h in handles))
                h = handles[0]
                assert tasks[h.id]["name"] == "gateway.infer"
                assert "hello" not in (tasks[h.id].get("args") or "")   # prompts stay out of Flower
                workers = processes.poll_json(client, f"{base}/api/workers?refresh=1",
                                              lambda body: len(body) >= 2)
                names = sorted(workers)
                assert any(n.startswith("w2-") for n in names)
                pages = ["/", "/workers", "/tasks", "/broker", "/metrics", "/healthcheck",
                         "/api/workers?refresh=1", "/api/tasks", "/api/task/types", "/api/queues/length",
                         "/tasks/datatable?draw=1&start=0&length=100&search%5Bvalue%5D=&order%5B0%5D%5Bcolumn%5D=0"
                         "&columns%5B0%5D%5Bdata%5D=name&order%5B0%5D%5Bdir%5D=asc"]
                pages += [f"/worker/{n}" for n in names]
                pages += [f"/task/{x.id}" for x in handles] + [f"/api/task/info/{x.id}" for x in handles]
                scraped = {}
                for x in handles:   # no result backend: results (tenants' data) are not Flower's
                    resp = client.get(f"{base}/api/task/result/{x.id}", timeout=10)
                    assert resp.status_code == 503, resp.text[:200]
                for path in pages:
                    resp = client.get(base + path, timeout=10)
                    assert resp.status_code == 200, (path, resp.status_code, resp.text[:200])
                    scraped[path] = resp.text
            worker_page = scraped[f"/worker/{names[-1]}"]
            # the page really lists the broker's transport options -- the public settings only
            assert "gateway_public_settings" in worker_page and "global_keyprefix" in worker_page
            replies = inspect_replies(gw.app)
            assert len(replies["stats"]) == 2 and len(replies["conf"]) == 2
            everything = "\n".join(scraped.values()) + json.dumps(replies, default=str)
            for secret in (PLANTED_KEY, OWN_KEY, "SECRET"):
                hits = [p for p, text in scraped.items() if secret in text]
                assert secret not in everything, f"{secret!r} shown by {hits or 'inspect'}"
            assert not re.search(r"\bsk-[A-Za-z0-9-]{12,}", everything)   # no key-shaped string at all
        finally:
            flower.stop()
            w1.stop()
            w2.stop()


def test_flower_command_defaults_to_loopback_and_always_asks_for_auth(monkeypatch):
    argv = flower_cli.flower_argv()
    assert "--address=127.0.0.1" in argv and argv[argv.index("-A") + 1] == "gateway_tasks.cli.flower"
    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    auth, generated = flower_cli.basic_auth_from({})
    user, password = auth.split(":", 1)
    assert generated and user == "admin" and len(password) >= 20
    assert flower_cli.basic_auth_from({"FLOWER_BASIC_AUTH": "ops:pw"}) == ("ops:pw", False)
    env = flower_cli.flower_env("ops:pw", {"FLOWER_UNAUTHENTICATED_API": "true"})
    assert env["FLOWER_BASIC_AUTH"] == "ops:pw" and "FLOWER_UNAUTHENTICATED_API" not in env
    from gateway_tasks.core.errors import ConfigError
    with pytest.raises(ConfigError, match="user:password"):
        flower_cli.basic_auth_from({"FLOWER_BASIC_AUTH": "no-colon"})
