"""Telling Redis's "at maxmemory" refusal apart from other errors, on Redis 6.2 and 7.

With ``maxmemory`` and ``noeviction`` Redis refuses every command that may grow
memory (``-OOM command not allowed when used memory > 'maxmemory'``), and a
script's first such write.  redis-py raises ``OutOfMemoryError`` for a plain
command, and for a script's refused write on Redis 7, which keeps the error's
code; Redis 6.2 wraps a script's error as ``ERR Error running script ...: -OOM
command not allowed ...``, a plain ``ResponseError``.  ``is_out_of_memory``
recognises both, and kombu's errors that carry the message.
"""

from __future__ import annotations

import redis

OOM_MESSAGE = "command not allowed when used memory > 'maxmemory'"


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write because it is at its maxmemory."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or OOM_MESSAGE in str(exc)
