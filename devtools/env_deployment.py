"""A local deployment started the way a user starts one, for the tests of the
documented ways to configure it.

Every process -- a ``celery -A workers.app worker``, ``gateway api``, optionally
``celery -A beat.app beat`` and ``gateway flower``, and the ``gateway`` commands run
with ``EnvDeployment.gateway`` -- gets the environment a user would export
(``env``: REDIS_URL, GATEWAY_KEY_PREFIX, GATEWAY_CONFIG, GATEWAY_POOLS_JSON...),
never a GATEWAY_SETTINGS_JSON written for it, and none of this process's own
GATEWAY_* configuration.  The worker alone also gets ``worker_env`` (the upstream's
key: only workers call the upstream, so only they need it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from gateway_tasks.core.errors import StartupError
from gateway_tasks.core.settings import SETTINGS_ENV_VARS, load_settings
from devtools import processes
from gateway_tasks.local.ports import free_port

# this process's own configuration (every variable settings are loaded from), never
# inherited by a child: a child's come from ``env`` alone
CONFIG_VARS = SETTINGS_ENV_VARS
FLOWER_AUTH = "admin:env-deployment-flower"
START_TIMEOUT_S = 90.0


@dataclass
class EnvDeployment:
    env: dict[str, str]
    log_dir: Path
    worker_env: dict[str, str] = field(default_factory=dict)
    api_port: int = field(default_factory=free_port)
    children: dict[str, processes.Child] = field(default_factory=dict)

    def process_env(self, *, worker: bool = False) -> dict[str, str]:
        """A child's environment: this one's without its configuration (nor, but for the
        worker, the variables of ``worker_env``), then ``env``, then the worker's own."""
        dropped = {*CONFIG_VARS, *self.worker_env}
        base = {k: v for k, v in os.environ.items() if k not in dropped}
        return {**base, **self.env, **(self.worker_env if worker else {})}

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def gateway(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``gateway ARGS...`` with the deployment's environment (not the worker's)."""
        return subprocess.run(processes.gateway_argv(*args), env=self.process_env(), capture_output=True,
                              text=True, timeout=timeout_s)

    def start(self, also: Sequence[str] = ()) -> "EnvDeployment":
        """A worker and the API (and ``also``: "beat", "flower"), each started as a user would,
        then wait until `gateway ready` sees the worker and the API's /healthz."""
        env = self.process_env()
        settings = load_settings(env=env)   # the queues to consume: as a user reads them off the config
        self.children["worker"] = processes.worker(
            settings, concurrency=2, loglevel="info", env=self.process_env(worker=True),
            log_path=str(self.log_path("worker")))
        self.children["api"] = processes.api(env, port=self.api_port, log_path=str(self.log_path("api")))
        if "beat" in also:
            self.children["beat"] = processes.Child(
                [sys.executable, "-m", "celery", "-A", "beat.app", "beat", "-l", "info"], env,
                str(self.log_path("beat")))
        if "flower" in also:
            self.children["flower"] = processes.Child(
                processes.gateway_argv("flower", "--port", str(free_port())),
                {**env, "FLOWER_BASIC_AUTH": FLOWER_AUTH}, str(self.log_path("flower")))
        for child in self.children.values():
            child.start()
        ready = self.gateway("ready", "--workers", "1", "--url", f"{self.api_url}/healthz",
                             "--timeout-s", str(START_TIMEOUT_S), timeout_s=START_TIMEOUT_S + 30)
        if ready.returncode != 0:
            self.stop()
            raise StartupError(f"the deployment did not come up: {ready.stderr.strip()}\n{self.log_tails()}")
        return self

    def wait_for_log(self, name: str, text: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """The log of child ``name`` once it holds ``text`` (StartupError if it never does)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            log = self.log(name)
            if text in log:
                return log
            if not self.children[name].alive():
                break
            time.sleep(0.2)
        raise StartupError(f"{name} never logged {text!r}:\n{self.log(name)[-3000:]}")

    def add_tenant(self, tenant: str, tier: str) -> str:
        """Register a tenant with `gateway tenant add`; its API key."""
        done = self.gateway("tenant", "add", tenant, "--tier", tier)
        if done.returncode != 0:
            raise StartupError(f"gateway tenant add failed: {done.stderr.strip()}")
        return json.loads(done.stdout)["api_key"]

    def chat(self, tenant_key: str, content: str) -> httpx.Response:
        """One synchronous chat completion through the API (POST /v1/chat/completions)."""
        return httpx.post(f"{self.api_url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {tenant_key}"},
                          json={"messages": [{"role": "user", "content": content}], "max_tokens": 16})

    def log(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> dict[str, str]:
        return {name: self.log(name) for name in self.children}

    def log_tails(self, chars: int = 2000) -> str:
        return "\n".join(f"--- {name}:\n{text[-chars:]}" for name, text in self.logs().items())

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            child.stop()

    def __enter__(self) -> "EnvDeployment":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
