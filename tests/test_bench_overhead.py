"""bench-overhead's own parts: the lean load client against real HTTP servers (the upstream
simulator, and a server answering in chunks or closing), and how CPU per request is summed."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

import pytest

from devtools.bench import http_load
from devtools.bench.http_load import Connection, HttpError, Post
from devtools.bench.overhead import REQUEST, UPSTREAM_KEY, cpu_spread
from gateway_tasks.simulator import SimConfig, SimulatorThread


def test_the_client_posts_and_reads_replies_on_one_kept_connection():
    with SimulatorThread(SimConfig(base_latency_ms=0, ms_per_output_token=0, api_key=UPSTREAM_KEY)) as sim:
        conn = Connection(Post.of(f"{sim.base_url}/chat/completions", REQUEST, UPSTREAM_KEY))
        bad = Connection(Post.of(f"{sim.base_url}/chat/completions", REQUEST, "sk-wrong"))

        async def three() -> list[tuple[int, bytes]]:
            got = [await conn.send() for _ in range(2)]
            got.append(await bad.send())
            conn.close()
            bad.close()
            return got
        replies = http_load.run(three)
    assert [status for status, _ in replies] == [200, 200, 401]
    assert json.loads(replies[0][1])["object"] == "chat.completion"


class _Chunked(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:   # noqa: N802 -- http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("transfer-encoding", "chunked")
        self.send_header("connection", "close")
        self.end_headers()
        for part in (b'{"a": ', b'1}'):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


def test_a_chunked_reply_that_closes_is_read_and_the_next_request_reconnects():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Chunked)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conn = Connection(Post.of(f"http://127.0.0.1:{server.server_address[1]}/x", {"q": 1}, "k"))

    async def twice() -> list[tuple[int, bytes]]:
        return [await conn.send(), await conn.send()]
    try:
        replies = http_load.run(twice)
    finally:
        server.shutdown()
    assert replies == [(200, b'{"a": 1}')] * 2


def test_a_refused_connection_is_an_http_error():
    import socket
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    conn = Connection(Post.of(f"http://127.0.0.1:{port}/x", {}, "k"))
    with pytest.raises(HttpError):
        http_load.run(conn.send)


def test_cpu_spread_sums_the_workers_and_spreads_each_process():
    runs = [{"cpu_ms_per_request": {"api": 2.0, "worker0": 1.0, "worker1": 1.5, "litellm": None}},
            {"cpu_ms_per_request": {"api": 1.0, "worker0": 2.0, "worker1": 0.5}}]
    out = cpu_spread(runs)
    assert out["workers"] == {"median": 2.5, "min": 2.5, "max": 2.5, "runs": 2}
    assert out["api"] == {"median": 1.5, "min": 1.0, "max": 2.0, "runs": 2}
    assert "litellm" not in out
