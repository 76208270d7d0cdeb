"""A streaming task's chunks, from the worker to the API process waiting on them.

One Redis stream per task (``Keys.chunks(task_id)``, a TTL so an abandoned one
goes away).  The worker appends, in order::

    chunk  {"data": <one chat.completion.chunk, as the upstream sent it>}
    ...
    done   {"usage": {...}}                       the upstream's stream ended
    error  {"type": ..., "message": ...}          or it broke (nothing follows)

A stream, not pub/sub: the reader may start after the first chunks were
written (it reads from the beginning), and a reader that reconnects misses
nothing.  ``read`` blocks at most ``block_ms`` for the next entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from gateway_tasks.core.keys import Keys

CHUNK, DONE, ERROR = "chunk", "done", "error"
DEFAULT_TTL_S = 600
MAXLEN = 100_000           # a runaway stream is capped (approximately), never unbounded


@dataclass(frozen=True)
class Event:
    id: str
    kind: str              # CHUNK, DONE or ERROR
    data: dict[str, Any]


class ChunkWriter:
    """The worker's side: appends events (each with the key's TTL refreshed)."""

    def __init__(self, client: redis.Redis, keys: Keys, task_id: str, ttl_s: int = DEFAULT_TTL_S):
        self.r = client
        self.key = keys.chunks(task_id)
        self.ttl_s = ttl_s
        self.written = 0

    def started_before(self) -> bool:
        """Whether an earlier attempt of this task already wrote to the stream."""
        return bool(self.r.exists(self.key))

    def _add(self, kind: str, data: dict[str, Any]) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key, {"kind": kind, "data": json.dumps(data, separators=(",", ":"))},
                      maxlen=MAXLEN, approximate=True)
            pipe.expire(self.key, self.ttl_s)
            pipe.execute()
        self.written += 1

    def chunk(self, chunk: dict[str, Any]) -> None:
        self._add(CHUNK, chunk)

    def done(self, usage: dict[str, Any] | None) -> None:
        self._add(DONE, {"usage": usage})

    def error(self, type_: str, message: str, upstream: dict[str, Any] | None = None) -> None:
        """The task failed; ``upstream``: the upstream's own error object when it refused the
        request (a 4xx), which the client gets as it is."""
        self._add(ERROR, {"type": type_, "message": message, **({"upstream": upstream} if upstream else {})})


def read(client: redis.Redis, keys: Keys, task_id: str, after_id: str = "0-0",
         block_ms: int = 1000, count: int = 256) -> list[Event]:
    """The events after ``after_id`` (waiting up to ``block_ms`` for the first)."""
    reply = client.xread({keys.chunks(task_id): after_id}, count=count, block=block_ms)
    out: list[Event] = []
    for _key, entries in reply or []:
        for entry_id, fields in entries:
            kind = fields.get(b"kind", b"").decode()
            try:
                data = json.loads(fields.get(b"data", b"{}"))
            except ValueError:
                data = {"type": "BadChunk", "message": "an unreadable stream entry"}
                kind = ERROR
            out.append(Event(entry_id.decode() if isinstance(entry_id, bytes) else entry_id, kind, data))
    return out
