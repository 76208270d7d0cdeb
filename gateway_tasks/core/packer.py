"""How commands are packed into RESP on the gateway's own Redis connections.

redis-py (with hiredis) runs every argument through its ``Encoder`` in Python --
type checks and an ``encode`` call per argument -- before handing the tuple to
``hiredis.pack_command``, which accepts ``str``, ``bytes``, ``int`` and ``float``
itself and encodes them the same way (UTF-8; ``repr`` of a number).  A pick.lua
call has ~58 arguments and a release.lua call ~36, so redis-py's encoding costs a
dispatcher several times what hiredis alone takes to pack the same call, and a beat
leader submitting a cron storm spends a large share of its time there.  ``FastPacker`` hands the arguments straight to hiredis and
falls back to redis-py's own packer for anything hiredis refuses (a ``bool``,
``None``, a ``memoryview``), which then raises redis-py's ``DataError`` or packs it
as redis-py always did.  The bytes on the wire are the same.

``connection_kwargs`` is what a client or connection pool of the gateway is made
with (``redis.Redis.from_url(url, **connection_kwargs())``); without hiredis it is
empty and redis-py's own packer is used.
"""

from __future__ import annotations

from typing import Any

from redis.connection import PythonRespSerializer
from redis._parsers.encoders import Encoder

try:
    import hiredis
except ImportError:      # pragma: no cover - hiredis is a dependency; this keeps the import safe
    hiredis = None

BUFFER_CUTOFF_B = 6000   # redis-py's own: larger arguments are sent as separate buffers


class FastPacker:
    """A redis-py command packer (``Connection(command_packer=...)``): hiredis directly."""

    def __init__(self) -> None:
        encoder = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)
        self._fallback = PythonRespSerializer(BUFFER_CUTOFF_B, encoder.encode)

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        first = args[0]
        # a command name given with its subcommand ("SCRIPT EXISTS") is two arguments, as
        # redis-py splits it
        if isinstance(first, str):
            if " " in first:
                args = tuple(first.encode().split()) + args[1:]
        elif isinstance(first, bytes) and b" " in first:
            args = tuple(first.split()) + args[1:]
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return self._fallback.pack(*args)


FAST_PACKER = FastPacker() if hiredis is not None else None


def connection_kwargs() -> dict[str, Any]:
    """The keyword arguments of a gateway client's connections: the fast packer."""
    return {"command_packer": FAST_PACKER} if FAST_PACKER is not None else {}
