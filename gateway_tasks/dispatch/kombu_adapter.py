"""kombu's Redis transport behind named methods: the one module that touches its private API.

The gateway's transport is kombu's Redis transport with some of kombu's private
methods replaced.  Each replaced method is routed here to a named hook whose
default is kombu's own method; the producer half (``gateway_tasks.dispatch.broker``)
and the consumer half (``gateway_tasks.dispatch.transport``) subclass ``Channel``, ``QoS`` and
``Transport`` below and override the hooks, never kombu's private names:

  kombu's                         hook here
  Channel._put / _size / _purge   put_message / queue_size / purge_queue
  Channel._get                    get_message        (basic_get)
  Channel._connparams             connection_params  (the redis-py connection kwargs)
  Channel._brpop_start            poll_start         (send the poll command)
  Channel._brpop_read             poll_read          (read its reply, deliver)
  Channel.client                  poll_client        (whose connection the poller waits on)

``client`` is the client whose ``connection`` kombu's poller registers and its
BRPOP commands use: kombu's own (``kombu_client``, on the broker's Redis) unless
``poll_client`` names another -- the gateway's consumer, when the deployment's Redis
is not the broker's (a Redis Cluster: the master owning its pool's slot), polls
there.  A connection of such a client is made of ``poll_connection_class``, which
tells kombu's poller when it disconnects, as kombu's own connections do.

A ``poll_start``/``poll_read`` that sends a command of its own instead of kombu's
BRPOP uses ``poll_begin``, ``read_poll_reply`` and ``poll_read_done``, which do
what kombu's ``_brpop_start``/``_brpop_read`` do around their command;
``deliver_message`` hands a message to the consumer.  ``QoS`` names the
in-memory half of kombu's ack emulation (without its unacked hash).

``tests/test_kombu_contract.py`` checks that every kombu name used here still
exists with the signature relied on, and that the kombu code mirrored here
(``_brpop_read``'s ``finally``, the restore throttle) has not changed.
"""

from __future__ import annotations

import contextlib
from queue import Empty
from typing import Any, Iterator

import redis
from kombu.transport import redis as kredis
from kombu.transport import virtual

__all__ = ["Channel", "Empty", "QoS", "Transport"]


class QoS(kredis.QoS):
    """kombu's Redis ack emulation (the unacked hash and index, restored after the
    visibility timeout), with its in-memory bookkeeping reachable on its own."""

    def record_delivery(self, message: Any, delivery_tag: str) -> None:
        """Count ``message`` as delivered and not yet acked (the prefetch limit), without
        writing kombu's unacked hash (``virtual.QoS.append``)."""
        virtual.QoS.append(self, message, delivery_tag)

    def forget_delivery(self, delivery_tag: str) -> None:
        """Stop counting a delivered message, without touching kombu's unacked hash
        (``virtual.QoS.ack``)."""
        virtual.QoS.ack(self, delivery_tag)

    def delivered_tags(self) -> list[Any]:
        """The tags of the messages delivered and not yet acked (``_delivered``'s keys)."""
        return list(self._delivered)

    def drop_delivered(self, delivery_tag: Any) -> None:
        """Remove a tag from the delivered messages at once, so that ``restore_unacked``
        does not restore it (``_delivered``)."""
        self._delivered.pop(delivery_tag, None)

    def restore_scanned(self, interval: int) -> bool:
        """After ``restore_visible(..., interval)``: whether that call was one that scans,
        not one its throttle skipped (``_vrestore_count``, every ``interval``-th call)."""
        return not (self._vrestore_count - 1) % (interval or 1)


class Channel(kredis.Channel):
    """kombu's Redis channel, its private methods routed to the named hooks below."""

    QoS = QoS

    # -- the hooks (kombu's behaviour unless overridden) ---------------------
    @property
    def client(self) -> redis.Redis:
        """The poll client (``poll_client``): kombu's poller registers its connection's
        socket, and kombu's BRPOP is sent on it."""
        return self.poll_client()

    def poll_client(self) -> redis.Redis:
        """The client whose connection carries the poll command (kombu: its own client)."""
        return self.kombu_client()

    def kombu_client(self) -> redis.Redis:
        """kombu's own client on the broker's Redis (made once, kept where kombu keeps it:
        its close and re-auth find it there)."""
        found = self.__dict__.get("client")
        if found is None:
            found = self.__dict__["client"] = self._create_client(asynchronous=True)
        return found

    def poll_connection_class(self, base: type[redis.Connection]) -> type[redis.Connection]:
        """A subclass of ``base`` whose connections, when they disconnect, tell the channel
        (and through it kombu's poller, which stops watching the socket), as the connections
        kombu makes itself do."""
        channel = self

        class PollConnection(base):  # type: ignore[valid-type, misc]
            def disconnect(self, *args: Any, **kwargs: Any) -> None:
                super().disconnect(*args, **kwargs)
                if channel._registered:
                    channel._on_connection_disconnect(self)

        return PollConnection

    def connection_params(self, asynchronous: bool = False) -> dict[str, Any]:
        """The keyword arguments of the channel's redis-py connections."""
        return super()._connparams(asynchronous)

    def put_message(self, queue: str, message: dict, **kwargs: Any) -> None:
        """Publish ``message`` (kombu's envelope, a dict) to ``queue``."""
        return super()._put(queue, message, **kwargs)

    def queue_size(self, queue: str) -> int:
        """How many messages wait in ``queue``."""
        return super()._size(queue)

    def purge_queue(self, queue: str) -> int:
        """Drop the messages waiting in ``queue``; returns how many."""
        return super()._purge(queue)

    def get_message(self, queue: str) -> Any:
        """One message of ``queue`` (basic_get), or raise ``Empty``."""
        return super()._get(queue)

    def poll_start(self, timeout: float | None = None) -> None:
        """Send the command whose reply the event loop waits for on the poll connection
        (kombu: BRPOP on the active queues).  Called whenever no poll is outstanding and
        the prefetch limit allows more messages."""
        super()._brpop_start(timeout)

    def poll_read(self, **options: Any) -> bool:
        """Read the reply to ``poll_start``'s command once it is readable, and deliver
        what it brought: True when something was delivered, else raise ``Empty``."""
        return super()._brpop_read(**options)

    # -- for a poll command of the gateway's own ------------------------------
    def poll_begin(self) -> redis.connection.Connection:
        """The poll connection, with the channel marked as awaiting a reply on it
        (``_in_poll``: no second command is sent meanwhile, re-auth waits; and
        ``_brpop_sent_at``: kombu's health check drops a connection whose reply is overdue).
        The caller sends the one command on it."""
        conn = self.client.connection
        self._in_poll = conn
        self._brpop_sent_at = kredis.monotonic()
        return conn

    def read_poll_reply(self, command_name: str, **options: Any) -> Any:
        """The reply to the command sent on the poll connection, as redis-py parses it
        (kombu's prefixing client would strip its key prefix from a BRPOP-named reply).
        A connection error drops the connection, so that the next poll reconnects, and
        propagates.  Read it inside ``poll_read_done``."""
        conn = self.client.connection
        try:
            return redis.Redis.parse_response(self.client, conn, command_name, **options)
        except self.connection_errors:
            conn.disconnect()
            raise

    @contextlib.contextmanager
    def poll_read_done(self) -> Iterator[None]:
        """Around the read of a poll's reply, however it ends, what kombu's
        ``_brpop_read`` does in its ``finally``: the channel no longer awaits a reply, and
        a re-auth token that a streaming credential provider set on the poll connection
        meanwhile is sent now that the connection is idle (``_flush_brpop_reauth``)."""
        try:
            yield
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def deliver_message(self, payload: dict, queue: str) -> None:
        """Hand a message read from ``queue`` to the connection's consumers."""
        self.connection._deliver(payload, queue)

    # -- kombu's private methods, routed to the hooks -------------------------
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        return self.connection_params(asynchronous)

    def _put(self, queue: str, message: dict, **kwargs: Any) -> None:
        return self.put_message(queue, message, **kwargs)

    def _size(self, queue: str) -> int:
        return self.queue_size(queue)

    def _purge(self, queue: str) -> int:
        return self.purge_queue(queue)

    def _get(self, queue: str) -> Any:
        return self.get_message(queue)

    def _brpop_start(self, timeout: float | None = None) -> None:
        self.poll_start(timeout)

    def _brpop_read(self, **options: Any) -> bool:
        return self.poll_read(**options)


class Transport(kredis.Transport):
    """kombu's Redis transport on ``Channel``."""

    Channel = Channel
