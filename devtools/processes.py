"""Child processes of a local deployment: Celery workers, beat, `gateway api` and Flower
(``gateway_tasks.local.children.stop_process`` stops a single server process).

Used by `make demo`, the benchmark and the multi-process tests.  Each child
gets the complete settings as JSON in its environment, so it sees exactly the
deployment (Redis URL, key prefix, tiers, pools, policy) of its parent -- unless
it is given the environment a user would set instead (``env=``:
devtools.env_deployment).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from gateway_tasks.cli import flower as flower_cli
from gateway_tasks.core.errors import ConfigError, StartupError
from gateway_tasks.core.settings import SETTINGS_ENV_VARS, Settings, settings_to_json


def without_settings_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables settings are loaded from (SETTINGS_ENV_VARS:
    GATEWAY_CONFIG, GATEWAY_KEY_PREFIX, REDIS_PASSWORD...), the rest as it is."""
    dropped = set(SETTINGS_ENV_VARS)
    return {k: v for k, v in environ.items() if k not in dropped}


def child_env(settings: Settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its settings variables, then ``settings`` as
    GATEWAY_SETTINGS_JSON and its REDIS_URL, then ``extra``: the child loads exactly
    ``settings``, whatever GATEWAY_*/REDIS_* this process was started with."""
    env = without_settings_env(os.environ)
    env["GATEWAY_SETTINGS_JSON"] = settings_to_json(settings)
    env["REDIS_URL"] = settings.redis_url
    env.update(extra or {})
    return env


@dataclass
class Child:
    argv: list[str]
    env: dict[str, str]
    log_path: str = ""
    process: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)

    def start(self) -> "Child":
        out = subprocess.DEVNULL
        if self.log_path:
            self._log = open(self.log_path, "ab")
            out = self._log
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.alive():
            assert self.process is not None
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def kill(self) -> None:
        if self.alive():
            assert self.process is not None
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def celery_worker_argv(app_module: str, queues: Sequence[str], *, concurrency: int, pool: str,
                       name: str, loglevel: str = "warning") -> list[str]:
    """``celery -A app_module worker`` with the flags every local worker gets: task
    events on, gossip/mingle/heartbeat off, a node name unique to this run."""
    return [sys.executable, "-m", "celery", "-A", app_module, "worker",
            "-Q", ",".join(queues), "-c", str(concurrency), "-P", pool, "-E",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-n", f"{name}-{os.getpid()}-{time.monotonic_ns() % 100000}@%h", "-l", loglevel]


def worker(settings: Settings, *, queues: Sequence[str] | None = None, concurrency: int = 8,
           pool: str = "threads", name: str = "gw", log_path: str = "",
           loglevel: str = "warning", env: dict[str, str] | None = None) -> Child:
    """A worker on ``settings``' queues; its environment is ``child_env(settings)``, or
    ``env`` as given (the worker then loads its settings from that, as a user's does)."""
    if not settings.redis_url:
        raise ConfigError("a worker needs settings.redis_url")
    argv = celery_worker_argv("workers.app", list(queues or settings.queue_names()),
                              concurrency=concurrency, pool=pool, name=name, loglevel=loglevel)
    return Child(argv, child_env(settings) if env is None else env, log_path)


def beat(settings: Settings, *, schedule_path: str, log_path: str = "", loglevel: str = "warning") -> Child:
    """``celery -A beat.app beat`` on ``child_env(settings)``; ``schedule_path``: the file of
    Celery's own static schedule (tenant crons are in Redis)."""
    argv = [sys.executable, "-m", "celery", "-A", "beat.app", "beat", "-s", schedule_path, "-l", loglevel]
    return Child(argv, child_env(settings), log_path)


def gateway_argv(*args: str) -> list[str]:
    """The command line of ``gateway ARGS...`` run by this interpreter."""
    return [sys.executable, "-m", "gateway_tasks.cli", *args]


def api(env: dict[str, str], *, port: int, log_path: str = "") -> Child:
    """``gateway api`` on 127.0.0.1:``port`` with the environment ``env``."""
    return Child(gateway_argv("api", "--port", str(port)), env, log_path)


def flower(settings: Settings, *, port: int, basic_auth: str, log_path: str = "") -> Child:
    """Flower on 127.0.0.1, behind basic auth (``user:password``), as `gateway flower` runs it."""
    argv = flower_cli.flower_argv(port=port)
    return Child(argv, flower_cli.flower_env(basic_auth, child_env(settings)), log_path)


def wait_for_workers(app, count: int, timeout_s: float = 30.0) -> int:  # noqa: ANN001
    """Block until `count` workers answer a ping (or raise StartupError)."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        replies = app.control.ping(timeout=0.5) or []
        seen = len(replies)
        if seen >= count:
            return seen
        time.sleep(0.2)
    raise StartupError(f"only {seen} of {count} workers came up within {timeout_s}s; see their logs")


def poll_json(client: Any, url: str, ok: Callable[[Any], bool], timeout_s: float = 30.0) -> Any:
    """GET ``url`` with ``client`` (an httpx.Client) every 0.5 s until it answers 200 with JSON
    that ``ok`` accepts, and return that JSON; AssertionError with the last answer at the
    timeout (a process's HTTP pages -- Flower's, the API's -- filling in after it started)."""
    import httpx
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = client.get(url, timeout=5)
            if last.status_code == 200 and ok(last.json()):
                return last.json()
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never satisfied the check; last answer: {last and last.text[:500]}")
