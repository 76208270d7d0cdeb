"""The contract between ``gateway_tasks.dispatch.kombu_adapter`` and the installed kombu.

The adapter is the one place that uses kombu's private Redis-transport API.  These
tests fail when the installed kombu changes what it relies on:

* every kombu method it overrides or calls exists with the parameters it passes;
* every kombu attribute it reads or sets exists, of the kind it expects;
* the kombu code it mirrors or depends on (``_brpop_read``'s ``finally``, the restore
  throttle, how kombu calls the poll hooks, ...) still reads the same;
* its table below is complete: the adapter uses no private kombu name that is not in it,
  and the transport halves override no private kombu name themselves.

Each failure names the kombu name that changed and the adapter's method that uses it.
pyproject.toml pins kombu to the versions this passed on: widen the pin only with a
run of this file on the new version (and the adapter updated where it fails).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import kombu
import pytest
import redis
from kombu.transport import redis as kredis
from kombu.transport import virtual

from gateway_tasks.dispatch import broker, kombu_adapter
from gateway_tasks.dispatch import transport

ADAPTER = Path(kombu_adapter.__file__).resolve()
ADAPTER_FILE = "gateway_tasks/dispatch/kombu_adapter.py"


@dataclass(frozen=True)
class Used:
    """A kombu (or redis-py) method the adapter overrides or calls, with its parameters."""

    owner: type
    name: str
    params: tuple[str, ...]
    by: str   # the adapter's method relying on it

    def __str__(self) -> str:
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.name}"


METHODS = [
    # Channel: the methods routed to the hooks (kombu calls them; the hooks' defaults call kombu's)
    Used(kredis.Channel, "_put", ("self", "queue", "message", "**kwargs"), "Channel._put / put_message"),
    Used(kredis.Channel, "_size", ("self", "queue"), "Channel._size / queue_size"),
    Used(kredis.Channel, "_purge", ("self", "queue"), "Channel._purge / purge_queue"),
    Used(kredis.Channel, "_get", ("self", "queue"), "Channel._get / get_message"),
    Used(kredis.Channel, "_connparams", ("self", "asynchronous=False"),
         "Channel._connparams / connection_params"),
    Used(kredis.Channel, "_brpop_start", ("self", "timeout=None"), "Channel._brpop_start / poll_start"),
    Used(kredis.Channel, "_brpop_read", ("self", "**options"), "Channel._brpop_read / poll_read"),
    # Channel: called around the gateway's own poll command
    Used(kredis.Channel, "_flush_brpop_reauth", ("self",), "Channel.poll_read_done"),
    Used(virtual.Transport, "_deliver", ("self", "message", "queue"), "Channel.deliver_message"),
    Used(redis.Redis, "parse_response", ("self", "connection", "command_name", "**options"),
         "Channel.read_poll_reply"),
    # Channel: the poll client (kombu's own, or one of the deployment's Redis) and its connections
    Used(kredis.Channel, "_create_client", ("self", "asynchronous=False"), "Channel.kombu_client"),
    Used(kredis.Channel, "_on_connection_disconnect", ("self", "connection"), "Channel.poll_connection_class"),
    # QoS: the in-memory half of the ack emulation, and what the consumer half overrides
    Used(virtual.QoS, "append", ("self", "message", "delivery_tag"), "QoS.record_delivery"),
    Used(virtual.QoS, "ack", ("self", "delivery_tag"), "QoS.forget_delivery"),
    Used(kredis.QoS, "append", ("self", "message", "delivery_tag"), "gateway_tasks/dispatch/transport.py QoS.append"),
    Used(kredis.QoS, "ack", ("self", "delivery_tag"), "gateway_tasks/dispatch/transport.py QoS.ack"),
    Used(kredis.QoS, "reject", ("self", "delivery_tag", "requeue=False"), "gateway_tasks/dispatch/transport.py QoS.reject"),
    Used(kredis.QoS, "restore_by_tag", ("self", "tag", "client=None", "leftmost=False"),
         "gateway_tasks/dispatch/transport.py QoS.restore_by_tag"),
    Used(kredis.QoS, "restore_unacked", ("self", "client=None"),
         "QoS.delivered_tags / drop_delivered (gateway_tasks/dispatch/transport.py QoS.restore_unacked)"),
    Used(kredis.QoS, "restore_visible", ("self", "start=0", "num=10", "interval=10"),
         "QoS.restore_scanned (gateway_tasks/dispatch/transport.py QoS.restore_visible)"),
    Used(virtual.QoS, "can_consume_max_estimate", ("self",), "gateway_tasks/dispatch/transport.py Channel.poll_start"),
]

# the private kombu attributes the adapter reads or sets (not methods), and who relies on them
ATTRIBUTES = {
    "_in_poll": "Channel.poll_begin / poll_read_done",
    "_brpop_sent_at": "Channel.poll_begin",
    "_delivered": "QoS.delivered_tags / drop_delivered",
    "_vrestore_count": "QoS.restore_scanned",
    "_registered": "Channel.poll_connection_class",
}
# kombu's public names the adapter replaces on purpose, each routed to a hook
REPLACED = {"client": "Channel.poll_client"}
PRIVATE_NAMES = {m.name for m in METHODS if m.name.startswith("_")} | set(ATTRIBUTES)


def fail(name: str, problem: str, by: str) -> str:
    where = by if "/" in by else f"{ADAPTER_FILE} {by}"
    return (f"kombu {kombu.__version__}: {name} {problem}; the gateway relies on it in {where}.  "
            f"Update the adapter, then the kombu pin in pyproject.toml.")


def function_tree(fn: Callable[..., Any]) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def self_assignments(fn: Callable[..., Any]) -> dict[str, str]:
    """``self.<attr> = <value>`` statements of a function: attr -> value's source."""
    found = {}
    for node in ast.walk(function_tree(fn)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                found[target.attr] = ast.unparse(node.value)
    return found


def calls_in(fn: Callable[..., Any]) -> set[str]:
    """The called expressions of a function, as source (``self.client.connection.disconnect``)."""
    return {ast.unparse(n.func) for n in ast.walk(function_tree(fn)) if isinstance(n, ast.Call)}


# -- names and signatures -------------------------------------------------------------------

@pytest.mark.parametrize("used", METHODS, ids=str)
def test_every_kombu_method_the_adapter_uses_keeps_its_parameters(used):
    method = getattr(used.owner, used.name, None)
    assert callable(method), fail(str(used), "is gone", used.by)
    params = tuple(str(p) for p in inspect.signature(method).parameters.values())
    assert params == used.params, fail(str(used), f"now takes ({', '.join(params)}), "
                                                  f"not ({', '.join(used.params)})", used.by)


def test_every_kombu_attribute_the_adapter_uses_is_there():
    ch = "kombu.transport.redis.Channel"
    # class defaults kombu's poller and health check read before a channel ever polled
    assert kredis.Channel._in_poll is False, fail(f"{ch}._in_poll", "is no longer False by default",
                                                  ATTRIBUTES["_in_poll"])
    assert "_brpop_sent_at" in vars(kredis.Channel) and kredis.Channel._brpop_sent_at is None, \
        fail(f"{ch}._brpop_sent_at", "is no longer a class attribute (None)", ATTRIBUTES["_brpop_sent_at"])
    # the poll connection: ``client.connection``, a cached client (the re-auth flush reads it
    # from the instance's __dict__) that is a redis.Redis (read_poll_reply parses with it)
    client = inspect.getattr_static(kredis.Channel, "client")
    assert hasattr(client, "__set_name__") and not isinstance(client, property), \
        fail(f"{ch}.client", "is no longer a cached property", "Channel.poll_begin / read_poll_reply")
    assert issubclass(kredis.PrefixedStrictRedis, redis.Redis), \
        fail("kombu.transport.redis.PrefixedStrictRedis", "is no longer a redis.Redis", "Channel.read_poll_reply")
    assert kredis.monotonic is time.monotonic, \
        fail("kombu.transport.redis.monotonic", "is no longer time.monotonic", "Channel.poll_begin")
    assert issubclass(kredis.Transport.connection_errors[0], BaseException), \
        fail("kombu.transport.redis.Transport.connection_errors", "changed", "Channel.read_poll_reply")
    # QoS state the in-memory helpers read
    qos = kredis.QoS(types.SimpleNamespace(do_restore=False))
    qos._on_collect.cancel()
    assert isinstance(qos._delivered, dict), \
        fail("kombu.transport.virtual.QoS._delivered", "is no longer a dict of tag -> message",
             ATTRIBUTES["_delivered"])
    assert qos._vrestore_count == 0, \
        fail("kombu.transport.redis.QoS._vrestore_count", "no longer starts at 0", ATTRIBUTES["_vrestore_count"])


def test_the_adapter_uses_no_private_kombu_name_missing_from_this_contract():
    """Every ``_name`` the adapter defines or reaches (kombu's, not dunders) is checked above."""
    tree = ast.parse(ADAPTER.read_text(encoding="utf-8"))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    private = {n for n in used if n.startswith("_") and not n.startswith("__")}
    assert private <= PRIVATE_NAMES, (f"{ADAPTER_FILE} uses kombu's private {sorted(private - PRIVATE_NAMES)} "
                                      f"without a check here: add it to METHODS or ATTRIBUTES")


def kombu_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__ if b.__module__.startswith("kombu.")]


@pytest.mark.parametrize("cls", [broker.Channel, broker.Transport, transport.Channel, transport.QoS,
                                 transport.Transport], ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_the_transport_halves_override_no_private_kombu_name(cls):
    """The halves override the adapter's hooks, never kombu's private methods directly."""
    overridden = [n for n in vars(cls) if n.startswith("_") and not n.startswith("__")
                  and any(n in vars(base) for base in kombu_bases(cls))]
    assert not overridden, (f"{cls.__module__}.{cls.__name__} overrides kombu's private {overridden}: "
                            f"route them through a hook of {ADAPTER_FILE}")


@pytest.mark.parametrize("cls", [kombu_adapter.Channel, kombu_adapter.QoS, kombu_adapter.Transport],
                         ids=lambda c: c.__name__)
def test_the_adapter_hooks_shadow_no_kombu_name(cls):
    """A hook named like a kombu method would replace it behind kombu's back."""
    hooks = [n for n in vars(cls) if not n.startswith("_") and n not in ("QoS", "Channel", *REPLACED)]
    clashing = [n for n in hooks if any(n in vars(base) for base in kombu_bases(cls))]
    assert not clashing, fail(f"{cls.__name__}'s base", f"now defines {clashing} itself", f"{cls.__name__}")


# -- the kombu code the adapter mirrors or depends on -----------------------------------------

def test_brpop_read_ends_as_poll_read_done_does():
    """kombu's read of the BRPOP reply, in its ``finally``: the channel no longer polls, and a
    pending re-auth token is flushed.  ``poll_read_done`` does the same for the gateway's reads."""
    tree = function_tree(kredis.Channel._brpop_read)
    outer = next(n for n in tree.body if isinstance(n, ast.Try))
    final = [ast.unparse(s) for s in outer.finalbody]
    assert final == ["self._in_poll = None", "self._flush_brpop_reauth()"], fail(
        "kombu.transport.redis.Channel._brpop_read", f"now ends with {final} in its finally",
        "Channel.poll_read_done")


def test_brpop_read_drops_the_connection_on_a_connection_error_as_read_poll_reply_does():
    tree = function_tree(kredis.Channel._brpop_read)
    handlers = [h for n in ast.walk(tree) if isinstance(n, ast.Try) for h in n.handlers
                if h.type is not None and ast.unparse(h.type) == "self.connection_errors"]
    bodies = [[ast.unparse(s) for s in h.body] for h in handlers]
    assert bodies == [["self.client.connection.disconnect()", "raise"]], fail(
        "kombu.transport.redis.Channel._brpop_read", f"now handles connection errors with {bodies}",
        "Channel.read_poll_reply")
    assert "self.client.parse_response" in calls_in(kredis.Channel._brpop_read), fail(
        "kombu.transport.redis.Channel._brpop_read", "no longer reads with client.parse_response",
        "Channel.read_poll_reply")


def test_brpop_start_marks_the_channel_as_poll_begin_does():
    marks = self_assignments(kredis.Channel._brpop_start)
    assert marks == {"_in_poll": "self.client.connection", "_brpop_sent_at": "monotonic()"}, fail(
        "kombu.transport.redis.Channel._brpop_start", f"now sets {marks}", "Channel.poll_begin")
    assert "self.client.connection.send_command" in calls_in(kredis.Channel._brpop_start), fail(
        "kombu.transport.redis.Channel._brpop_start", "no longer sends on client.connection",
        "Channel.poll_begin")


def test_kombu_calls_the_poll_hooks_where_the_adapter_routes_them():
    """The poller sends a poll (``_brpop_start``) while none is outstanding (``_in_poll``), and
    a readable poll connection is read through ``handlers['BRPOP']``, bound to ``_brpop_read``."""
    init = function_tree(kredis.Channel.__init__)
    handlers = [ast.unparse(n.value) for n in ast.walk(init) if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "self.handlers"]
    assert handlers and "'BRPOP': self._brpop_read" in handlers[0], fail(
        "kombu.transport.redis.Channel.__init__", f"now sets handlers = {handlers}", "Channel._brpop_read")
    register = function_tree(kredis.MultiChannelPoller._register_BRPOP)
    sends = [n for n in ast.walk(register) if isinstance(n, ast.If)
             and ast.unparse(n.test) == "not channel._in_poll"
             and [ast.unparse(s) for s in n.body] == ["channel._brpop_start()"]]
    assert sends, fail("kombu.transport.redis.MultiChannelPoller._register_BRPOP",
                       "no longer sends _brpop_start() while not channel._in_poll",
                       "Channel._brpop_start / poll_begin")


def test_restore_visible_throttles_as_restore_scanned_assumes():
    tree = function_tree(kredis.QoS.restore_visible)
    head = [ast.unparse(s) for s in tree.body if not isinstance(s, ast.Expr)][:2]
    assert head == ["self._vrestore_count += 1",
                    "if (self._vrestore_count - 1) % (interval or 1):\n    return"], fail(
        "kombu.transport.redis.QoS.restore_visible", f"now begins {head}", "QoS.restore_scanned")


def test_the_in_memory_qos_methods_stay_off_redis():
    """``record_delivery`` / ``forget_delivery`` call virtual.QoS's append / ack to count a
    delivery without kombu's unacked hash: those touch neither the channel nor Redis, and the
    Redis QoS's append / ack still add their Redis part around them."""
    for name, by in (("append", "QoS.record_delivery"), ("ack", "QoS.forget_delivery")):
        source = inspect.getsource(getattr(virtual.QoS, name))
        assert "self.channel" not in source, fail(f"kombu.transport.virtual.QoS.{name}",
                                                  "now uses the channel", by)
        assert f"super().{name}" in calls_in(getattr(kredis.QoS, name)), fail(
            f"kombu.transport.redis.QoS.{name}", f"no longer calls virtual.QoS.{name}", by)


def test_restore_unacked_restores_each_delivered_tag_by_tag():
    """The consumer half drops its own tags from ``_delivered`` before kombu's
    ``restore_unacked``, which restores the others through ``restore_by_tag``."""
    source = inspect.getsource(kredis.QoS.restore_unacked)
    assert "self._delivered" in source and "self.restore_by_tag" in calls_in(kredis.QoS.restore_unacked), fail(
        "kombu.transport.redis.QoS.restore_unacked", "no longer restores self._delivered by tag",
        "QoS.delivered_tags / drop_delivered")


def test_kombu_makes_its_client_and_connections_as_the_poll_client_hooks_assume():
    """``client`` is replaced by a property (``poll_client``): kombu's own client is made by
    ``_create_client(asynchronous=True)`` and kept in the instance's ``__dict__``, which
    ``kombu_client`` does too; kombu's asynchronous connections tell the channel when they
    disconnect (``_on_connection_disconnect``, once ``_registered``), as the connections of
    ``poll_connection_class`` do; and the poller reaches the poll connection through
    ``channel.client``."""
    made = inspect.getattr_static(kredis.Channel, "client").func
    assert "self._create_client" in calls_in(made) and "asynchronous=True" in inspect.getsource(made), \
        fail("kombu.transport.redis.Channel.client", "is no longer _create_client(asynchronous=True)",
             "Channel.kombu_client")
    connparams = inspect.getsource(kredis.Channel._connparams)
    assert "if channel._registered:" in connparams and "channel._on_connection_disconnect(self)" in connparams, \
        fail("kombu.transport.redis.Channel._connparams", "no longer makes connections that report their "
             "disconnect to the channel", "Channel.poll_connection_class")
    register = inspect.getsource(kredis.MultiChannelPoller._register_BRPOP)
    assert "ident = channel, channel.client, 'BRPOP'" in register, fail(
        "kombu.transport.redis.MultiChannelPoller._register_BRPOP", "no longer registers channel.client",
        REPLACED["client"])
    assert "chan.client.connection.disconnect()" in inspect.getsource(kredis.MultiChannelPoller.on_readable), \
        fail("kombu.transport.redis.MultiChannelPoller.on_readable", "no longer reaches channel.client",
             REPLACED["client"])
