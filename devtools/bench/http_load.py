"""A lean HTTP/1.1 load client for the benches: keep-alive connections, one request in flight
on each, the request's bytes built once.

The clients of ``bench-overhead`` share the CPU of the servers they measure: what they
spend is taken from what they measure.  httpx spends about 2.8 ms of CPU per request on a
2-core machine (more than the upstream simulator answering it); this client spends a small
fraction of that, so the figures show the servers' limits rather than the load generator's.  It speaks just
what the measured servers answer: a status line, headers, and a body framed by
Content-Length or chunked transfer encoding; a ``Connection: close`` reply or a dropped
connection opens a new one.  Runs on uvloop when it is installed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")


class HttpError(Exception):
    """The connection failed or the reply could not be read."""


@dataclass(frozen=True)
class Post:
    """One request, its bytes built once: POST ``url`` with a JSON body and a bearer key."""

    host: str
    port: int
    data: bytes

    @classmethod
    def of(cls, url: str, body: dict[str, Any], key: str) -> "Post":
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        payload = json.dumps(body).encode()
        head = (f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        return cls(host, port, head + payload)


class Connection:
    """One keep-alive connection; ``send`` returns (status, body), ``first_part`` the time
    to the first part of the body too."""

    def __init__(self, post: Post):
        self.post = post
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def send(self) -> tuple[int, bytes]:
        """The reply's status and whole body."""
        status, _, body = await self.first_part()
        return status, body

    async def first_part(self) -> tuple[int, float, bytes]:
        """The reply's status, the seconds from sending until the first part of its body came
        (a streamed reply's first chunk: its first server-sent events), and the whole body."""
        try:
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(self.post.host, self.post.port)
            self._writer.write(self.post.data)
            return await self._reply(time.perf_counter())
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self.close()
            raise HttpError(str(exc) or type(exc).__name__) from None

    async def _reply(self, sent: float) -> tuple[int, float, bytes]:
        reader = self._reader
        assert reader is not None
        first = None
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lines = head.lower().split(b"\r\n")
        length, chunked, close = None, False, False
        for line in lines[1:]:
            if line.startswith(b"content-length:"):
                length = int(line[15:])
            elif line.startswith(b"transfer-encoding:") and b"chunked" in line:
                chunked = True
            elif line.startswith(b"connection:") and b"close" in line:
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                parts.append((await reader.readexactly(size + 2))[:-2])
                first = first or time.perf_counter()
            body = b"".join(parts)
        else:
            body = await reader.readexactly(length or 0)
        if close:
            self.close()
        return status, (first or time.perf_counter()) - sent, body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


def run(coro_of: Callable[[], Awaitable[T]]) -> T:
    """Run a load on a fresh event loop (uvloop's when installed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro_of())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro_of())
