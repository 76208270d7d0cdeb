"""Local TCP ports for the child servers of a dev deployment (Redis, Flower,
the simulator): ``free_port`` finds one nothing is bound to right now,
``port_is_free`` says whether a given one is."""

from __future__ import annotations

import socket

from gateway_tasks.core.errors import ConfigError


def socket_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal such as ``::1``, else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket is bound to now (ConfigError if none can be)."""
    with socket.socket(socket_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError as exc:
            raise ConfigError(f"cannot bind a free port on {host}: {exc}") from None
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP socket could bind ``port`` on ``host`` now."""
    with socket.socket(socket_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
