"""The REST API served by uvicorn in a daemon thread on a free loopback port, for
tests and benchmarks that talk to it over real HTTP (``with ApiThread(gw) as api:``);
``serving`` puts a real worker process behind it."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator, Mapping

import httpx
import uvicorn

from devtools import processes
from gateway_tasks.core.errors import StartupError
from gateway_tasks.core.settings import Settings
from gateway_tasks.local.ports import free_port
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.rest.app import create_app


class ApiThread:
    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 10.0) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.root_url = f"http://{host}:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.app = create_app(gateway)
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, host=host, port=self.port, log_level="warning",
            access_log=False, lifespan="off"))
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (http://host:port/v1)."""
        return f"{self.root_url}/v1"

    def start(self) -> "ApiThread":
        self._thread = threading.Thread(target=self._server.run, name=f"api-{self.port}",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise StartupError(f"the API on {self.root_url} exited before answering /healthz")
            try:
                if httpx.get(f"{self.root_url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        self.stop()
        raise StartupError(f"the API on {self.root_url} did not answer /healthz within "
                           f"{self.startup_timeout_s:g} s")

    def stop(self) -> None:
        runner = getattr(self.app.state, "batch_runner", None)
        if runner is not None:
            runner.stop()
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def __enter__(self) -> "ApiThread":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@contextmanager
def serving(settings: Settings, tenants: Mapping[str, str], *, concurrency: int,
            log_path: str) -> Iterator[tuple[Gateway, ApiThread, dict[str, str]]]:
    """A deployment to talk to over HTTP: the tenants registered (id -> tier), one real worker
    (``concurrency`` threads, its log at ``log_path``) and the API in a thread; yields the
    gateway, the API and each tenant's key, and stops the worker afterwards."""
    gw = Gateway(settings)
    keys = {tenant: gw.register_tenant(tenant, tier) for tenant, tier in tenants.items()}
    worker = processes.worker(settings, concurrency=concurrency, log_path=log_path).start()
    try:
        processes.wait_for_workers(gw.app, 1)
        with ApiThread(gw) as api:
            yield gw, api, keys
    finally:
        worker.stop()
        gw.app.close()
