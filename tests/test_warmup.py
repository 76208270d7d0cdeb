"""A worker warms the openai SDK up before it takes tasks (workers.warmup), sets its GIL
switch interval and freezes its startup objects (workers.interpreter); the simulator and the
REST API load tiktoken's encoder before their first request."""

from __future__ import annotations

import logging
import re
import pytest

from gateway_tasks.core.settings import Pool
from gateway_tasks.core.tokens import encoding
from devtools import processes
from gateway_tasks.simulator import SimConfig, SimulatorThread
from gateway_tasks.producer.gateway import Gateway
from workers import warmup


def test_warm_sdk_parses_a_canned_reply_without_any_network():
    body = warmup.warm_sdk()
    assert body["model"] == warmup.WARMUP_MODEL and body["usage"]["total_tokens"] == 2
    assert body["choices"][0]["message"]["content"] == "ok"


def test_warm_worker_never_raises_and_builds_every_pool_client(settings, monkeypatch, caplog):
    from gateway_tasks.upstream import client as upstream
    pools = (Pool("a", base_url="http://127.0.0.1:9/v1", api_key="k", models=("m",), tpm=60_000, rpm=600),
             Pool("b", base_url="http://127.0.0.1:9/v2", api_key="k", models=("m",), tpm=60_000, rpm=600))
    assert warmup.warm_worker(settings.with_(pools=pools)) >= 0
    assert all(upstream.client_for(p) is upstream._clients[(p.base_url, p.api_key, p.timeout_s)] for p in pools)

    def broken() -> None:
        raise RuntimeError("sdk-secret-detail")
    monkeypatch.setattr(warmup, "warm_sdk", broken)
    with caplog.at_level(logging.WARNING, logger="workers.warmup"):
        assert warmup.warm_worker(settings) >= 0
    assert "warm-up failed" in caplog.text and "RuntimeError" in caplog.text
    assert "sdk-secret-detail" not in caplog.text     # the type only: nothing of the message


def test_encoder_is_loaded_once_per_process():
    assert encoding() is encoding()


@pytest.mark.slow
def test_a_real_worker_warms_up_before_it_serves(settings, r, tmp_path):
    with SimulatorThread(SimConfig(tpm=120_000, rpm=6_000, base_latency_ms=5)) as sim:
        pool = Pool("default", base_url=sim.base_url, api_key="k", models=("gpt-4o-mini",),
                    tpm=120_000, rpm=6_000)
        s = settings.with_(pools=(pool,))
        gw = Gateway(s, client=r)
        gw.register_tenant("acme", "vip")
        log = tmp_path / "worker.log"
        s = s.with_(worker_switch_interval_ms=0.5)    # workers.interpreter sets it in the worker's process
        worker = processes.worker(s, concurrency=2, log_path=str(log), loglevel="info").start()
        try:
            processes.wait_for_workers(gw.app, 1)
            h = gw.submit("acme", "hello", max_tokens=8)
            assert h.get(timeout=30)["response"]["usage"]["completion_tokens"] > 0
        finally:
            worker.stop()
            gw.app.close()
        text = log.read_text()
        assert "worker warmed up in" in text, text[-2000:]
        assert re.search(r"worker GIL switch interval 0\.5 ms; garbage collector: [\d,]+ startup objects frozen",
                         text), text[-2000:]
