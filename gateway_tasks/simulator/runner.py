"""Running the simulator: ``serve`` (foreground), ``SimulatorThread`` (in this
process, for tests) and ``SimulatorProcess`` (a child ``python -m
gateway_tasks.simulator.cli``, for the demo and the benchmark).  Both
runners wait for ``/health`` and expose ``base_url``, ``stats()`` and
``reset_stats()``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

import gateway_tasks
from gateway_tasks.core.errors import ConfigError, GatewayError, UpstreamError
from gateway_tasks.local.ports import free_port, socket_family
from gateway_tasks.local.children import stop_process
from gateway_tasks.simulator.admission import Simulator
from gateway_tasks.simulator.app import create_app
from gateway_tasks.simulator.config import SimConfig
from gateway_tasks.simulator.flags import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT, config_to_argv

ENTRY_MODULE = "gateway_tasks.simulator.cli"   # what SimulatorProcess runs with -m


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"simulator: cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def _server(config: SimConfig, host: str, port: int) -> uvicorn.Server:
    loop, http = config.uvicorn_loop_http
    return uvicorn.Server(uvicorn.Config(create_app(config), host=host, port=port, loop=loop, http=http,
                                         log_level="warning", access_log=False,
                                         lifespan="off"))


def serve(config: SimConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Run the simulator in the foreground until interrupted."""
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]
    print(f"simulate-upstream: {_url(host, bound_port)}/v1 (tpm={config.tpm}, rpm={config.rpm}, "
          f"burst_s={config.burst_s:g}, charge={config.charge}, "
          f"models={','.join(config.models)}, server stack {config.server_stack}, "
          f"{'API key required' if config.api_key else 'any API key'})", file=sys.stderr, flush=True)
    try:
        _server(config, host, bound_port).run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after a clean shutdown
        pass
    finally:
        sock.close()


def _wait_healthy(root_url: str, timeout_s: float, alive: Any) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            raise UpstreamError(f"simulator at {root_url} exited before answering /health")
        try:
            if httpx.get(f"{root_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.02)
    raise UpstreamError(f"simulator at {root_url} did not answer /health within "
                        f"{timeout_s:g}s ({last})")


class _Endpoint:
    root_url: str

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. http://127.0.0.1:PORT/v1."""
        return f"{self.root_url}/v1"

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.root_url}/stats", timeout=5.0)
        response.raise_for_status()
        return response.json()

    def reset_stats(self) -> None:
        httpx.post(f"{self.root_url}/stats/reset", timeout=5.0).raise_for_status()

    def calls(self) -> dict[str, Any]:
        """``GET /calls``: attempts, served and in-flight upstream calls per task id."""
        response = httpx.get(f"{self.root_url}/calls", timeout=5.0)
        response.raise_for_status()
        return response.json()

    def set_fault(self, mode: str, for_s: float = 0.0, **options: float) -> dict[str, Any]:
        """``POST /faults``: answer every chat request with ``mode`` for ``for_s`` seconds."""
        response = httpx.post(f"{self.root_url}/faults", json={"mode": mode, "for_s": for_s, **options},
                              timeout=5.0)
        response.raise_for_status()
        return response.json()


class SimulatorThread(_Endpoint):
    """Run the simulator in a daemon thread (``with SimulatorThread(cfg) as sim:``).

    ``port=0`` picks a free loopback port.  ``.simulator`` is the live state.
    """

    def __init__(self, config: SimConfig | None = None, port: int = 0,
                 host: str = DEFAULT_HOST, startup_timeout_s: float = 10.0) -> None:
        self.config = config or SimConfig()
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self.root_url = _url(host, self.port)
        self._server = _server(self.config, host, self.port)
        self.simulator: Simulator = self._server.config.app.state.simulator
        self._thread: threading.Thread | None = None

    def start(self) -> "SimulatorThread":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"simulator-{self.port}", daemon=True)
        self._thread.start()
        try:
            _wait_healthy(self.root_url, self.startup_timeout_s, self._thread.is_alive)
        except GatewayError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> "SimulatorThread":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class SimulatorProcess(_Endpoint):
    """Run the simulator as ``python -m gateway_tasks.simulator.cli`` in a subprocess.

    ``port=0`` picks a free port first.  Its output goes to ``.log_path``,
    quoted in the error if it fails to start and removed on stop.
    """

    def __init__(self, config: SimConfig | None = None, port: int = 0,
                 host: str = DEFAULT_HOST, startup_timeout_s: float = 30.0,
                 python: str = sys.executable) -> None:
        self.config = config or SimConfig()
        self.host = host
        self.port = port or free_port(host)
        self.root_url = _url(host, self.port)
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = ""

    def argv(self) -> list[str]:
        return [self.python, "-m", ENTRY_MODULE, "--host", self.host,
                "--port", str(self.port), *config_to_argv(self.config)]

    def start(self) -> "SimulatorProcess":
        project_root = str(Path(gateway_tasks.__file__).resolve().parent.parent)  # holds gateway_tasks/
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (project_root, env.get("PYTHONPATH")) if p)
        env[API_KEY_ENV] = self.config.api_key
        fd, self.log_path = tempfile.mkstemp(prefix="gateway-simulator-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        proc = self.proc
        try:
            _wait_healthy(self.root_url, self.startup_timeout_s, lambda: proc.poll() is None)
        except GatewayError as exc:
            tail = Path(self.log_path).read_text(errors="replace")[-2000:]
            self.stop()
            raise UpstreamError(f"{exc}; simulator output:\n{tail}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s=10.0)
            self.proc = None
        if self.log_path:
            Path(self.log_path).unlink(missing_ok=True)
            self.log_path = ""

    def __enter__(self) -> "SimulatorProcess":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
