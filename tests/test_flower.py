"""Flower sees the gateway's workers and tasks (events on, JSON only, secrets censored)."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway_tasks.devtools import processes
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.devtools.ports import free_port
from gateway_tasks.core.settings import Pool
from gateway_tasks.devtools.simulator import SimConfig, SimulatorThread

pytestmark = pytest.mark.slow


def poll(url: str, ok, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=5)
            if last.status_code == 200 and ok(last.json()):
                return last.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never satisfied the check; last answer: {last and last.text[:300]}")


def test_flower_lists_worker_and_gateway_tasks(settings, r, tmp_path):
    with SimulatorThread(SimConfig(base_latency_ms=1)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="sk-very-secret", models=("gpt-4o-mini",),
                    tpm=600_000, rpm=6_000)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        port = free_port()
        worker = processes.worker(s, concurrency=2, log_path=str(tmp_path / "w.log")).start()
        flower = processes.flower(s, port=port, log_path=str(tmp_path / "f.log")).start()
        try:
            processes.wait_for_workers(gw.app, 1)
            base = f"http://127.0.0.1:{port}"
            h = gw.submit("acme", "hello", max_tokens=5)
            h.get(timeout=30)
            tasks = poll(f"{base}/api/tasks", lambda body: h.id in body)
            assert tasks[h.id]["name"] == "gateway.infer"
            assert "hello" not in (tasks[h.id].get("args") or "")   # prompts stay out of Flower
            workers = poll(f"{base}/api/workers?refresh=1", lambda body: len(body) >= 1)
            conf = next(iter(workers.values())).get("conf", {})
            assert "sk-very-secret" not in str(conf)
        finally:
            flower.stop()
            worker.stop()
