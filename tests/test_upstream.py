"""gateway_tasks.upstream.client: what a reply says of the upstream's own time, and which of its 4xx
are the caller's error (``refusal_of``)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway_tasks.core.errors import UpstreamRejected
from gateway_tasks.core.settings import Pool
from gateway_tasks.upstream.client import UNKNOWN_ERROR_TYPE, processing_ms, refusal_of


@pytest.mark.parametrize("headers,expected", [
    ({"openai-processing-ms": "173"}, 173.0),
    ({"openai-processing-ms": "0"}, 0.0),
    ({"openai-processing-ms": "12.5"}, 12.5),
    ({}, None),                                          # another provider sends none
    ({"openai-processing-ms": ""}, None),
    ({"openai-processing-ms": "soon"}, None),
    ({"openai-processing-ms": "-3"}, None),
    ({"openai-processing-ms": "nan"}, None),
    ({"openai-processing-ms": "inf"}, None),
])
def test_processing_ms_is_the_upstreams_own_time_or_none(headers, expected):
    assert processing_ms(headers) == expected


def status_error(status: int, body: object) -> openai.APIStatusError:
    """An SDK status error as ``refusal_of`` reads it: its status, decoded body and message."""
    exc = openai.APIStatusError.__new__(openai.APIStatusError)
    exc.status_code, exc.body, exc.message = status, body, f"Error code: {status}"
    return exc


@pytest.mark.parametrize("status", [401, 403, 429, 500, 502, 503])
def test_not_the_callers_error_is_no_refusal(status):
    body = {"message": "Incorrect API key provided: sk-abc***xyz", "type": "invalid_request_error",
            "param": None, "code": "invalid_api_key"}
    assert refusal_of(status_error(status, body)) is None


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422])
def test_a_callers_4xx_keeps_the_upstreams_status_and_error_object(status):
    body = {"message": "Unknown parameter: 'x'.", "type": "invalid_request_error", "param": "x",
            "code": "unknown_parameter"}
    refused = refusal_of(status_error(status, body))
    assert isinstance(refused, UpstreamRejected) and refused.status == status
    assert refused.openai_error() == body
    assert str(refused) == f"the upstream refused the request ({status}): Unknown parameter: 'x'."


def test_a_refusal_in_another_shape_keeps_its_text():
    refused = refusal_of(status_error(400, "<html>Bad Request</html>"))
    assert refused.openai_error() == {"message": "<html>Bad Request</html>", "type": UNKNOWN_ERROR_TYPE,
                                      "param": None, "code": None}
    numbered = refusal_of(status_error(400, {"message": "bad", "code": 1234}))
    assert numbered.code == "1234" and numbered.type == UNKNOWN_ERROR_TYPE


def test_the_client_is_built_on_the_sdks_own_http_library():
    """openai 3.x runs on httpx2 (earlier ones on httpx): the pool's client and the errors
    chat_stream recognises mid-stream are that library's."""
    import openai

    from gateway_tasks.upstream import client as upstream
    pool = Pool("p", base_url="http://127.0.0.1:9/v1", api_key="k", models=("m",), tpm=1_000, rpm=10)
    client = upstream.client_for(pool)
    assert isinstance(client._client, openai.DefaultHttpxClient.__mro__[1])
    assert upstream.SDK_HTTP.Client is openai.DefaultHttpxClient.__mro__[1]


def test_a_stream_cut_mid_way_by_the_connection_is_stream_broken():
    """The upstream sends two chunks of a body it declared longer, then closes the
    connection: a transport error of the SDK's HTTP library after chunks were passed on
    is StreamBroken (never retried)."""
    import json
    import socket
    import threading

    from gateway_tasks.upstream.client import StreamBroken, chat_stream
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "partial "}, "finish_reason": None}]}
    sent = "".join(f"data: {json.dumps(chunk)}\n\n" for _ in range(2)).encode()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"content-length: %d\r\n\r\n" % (len(sent) + 1000) + sent)
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    pool = Pool("cut", base_url=f"http://127.0.0.1:{port}/v1", api_key="k", models=("m",), tpm=100_000,
                rpm=1_000, timeout_s=10)
    got: list = []
    with pytest.raises(StreamBroken, match="after 2 chunks"):
        chat_stream(pool, "m", [{"role": "user", "content": "hi"}], 10, None, got.append, prompt_tokens=5)
    assert len(got) == 2
    thread.join(timeout=10)


def _serving(status: int, payload: bytes, *, api_key: str = "k",
             seen: dict[str, Any] | None = None) -> tuple[Pool, Any]:
    """A one-route HTTP server on a free port answering every POST with ``payload``; ``seen``
    (when given) gets the last request's path, authorization and task id headers and JSON body."""
    import http.server
    import json
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:   # noqa: N802 -- http.server's name
            raw = self.rfile.read(int(self.headers["content-length"]))
            if seen is not None:
                seen.update(path=self.path, auth=self.headers["authorization"],
                            task=self.headers["x-gateway-task-id"], body=json.loads(raw))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pool = Pool("raw", base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key=api_key,
                models=("m",), tpm=100_000, rpm=1_000, timeout_s=10)
    return pool, server


def test_a_chat_reply_is_the_upstreams_json_as_it_sent_it():
    """The body is the upstream's object field for field -- a vendor's extra field kept, no
    field of the SDK's models added -- and its usage counts the tokens."""
    import json

    from gateway_tasks.upstream.client import chat
    sent = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
            "x_vendor": {"region": "eu"}}
    pool, server = _serving(200, json.dumps(sent).encode())
    try:
        reply = chat(pool, "m", [{"role": "user", "content": "hi"}], 10)
    finally:
        server.shutdown()
    assert reply.body == sent
    assert (reply.prompt_tokens, reply.completion_tokens, reply.total_tokens) == (7, 2, 9)


def test_a_reply_that_is_no_json_object_is_an_upstream_error():
    from gateway_tasks.core.errors import UpstreamError
    from gateway_tasks.upstream.client import chat
    pool, server = _serving(200, b"[1, 2]")
    try:
        with pytest.raises(UpstreamError, match="without a JSON object"):
            chat(pool, "m", [{"role": "user", "content": "hi"}], 10)
    finally:
        server.shutdown()


@pytest.mark.parametrize("status, payload, raised", [
    (429, b'{"error": {"message": "slow down", "type": "rate_limit"}}', openai.RateLimitError),
    (500, b"boom", openai.InternalServerError),
    (503, b'{"error": {"message": "overloaded"}}', openai.InternalServerError),
    (401, b'{"error": {"message": "bad key sk-..."}}', openai.AuthenticationError),
])
def test_an_upstreams_failure_is_the_sdks_own_exception(status, payload, raised):
    """A JSON call's failure is raised as the SDK raises it (the pipeline and the failover
    catch the SDK's types): its class by status, its message, its body's error object."""
    from gateway_tasks.upstream.client import chat
    pool, server = _serving(status, payload)
    try:
        with pytest.raises(raised) as caught:
            chat(pool, "m", [{"role": "user", "content": "hi"}], 10)
    finally:
        server.shutdown()
    assert type(caught.value) is raised and caught.value.status_code == status
    assert str(caught.value).startswith(f"Error code: {status}")


def test_a_callers_4xx_from_a_json_call_is_upstream_rejected():
    from gateway_tasks.upstream.client import embed
    pool, server = _serving(400, b'{"error": {"message": "input too long", "type": "invalid_request_error", '
                                 b'"param": "input", "code": "too_long"}}')
    try:
        with pytest.raises(UpstreamRejected) as caught:
            embed(pool, "m", "some text")
    finally:
        server.shutdown()
    assert caught.value.openai_error() == {"message": "input too long", "type": "invalid_request_error",
                                           "param": "input", "code": "too_long"}


def test_a_refused_connection_and_a_timeout_are_the_sdks_errors():
    import socket
    from gateway_tasks.upstream.client import chat
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()                                  # nothing listens there now
    refused = Pool("refused", base_url=f"http://127.0.0.1:{port}/v1", api_key="k", models=("m",), tpm=1_000,
                   rpm=10, timeout_s=5)
    with pytest.raises(openai.APIConnectionError):
        chat(refused, "m", [{"role": "user", "content": "hi"}], 10)
    silent = socket.create_server(("127.0.0.1", 0))   # accepts, never answers
    try:
        slow = Pool("slow", base_url=f"http://127.0.0.1:{silent.getsockname()[1]}/v1", api_key="k",
                    models=("m",), tpm=1_000, rpm=10, timeout_s=0.3)
        with pytest.raises(openai.APITimeoutError):
            chat(slow, "m", [{"role": "user", "content": "hi"}], 10)
    finally:
        silent.close()


def test_the_request_carries_the_key_the_task_id_and_the_parameters():
    """What the upstream receives from a chat call: the pool's key as a bearer token, the task
    id header, and the body's parameters with extra_body's merged in."""
    import json
    from gateway_tasks.upstream.client import chat
    seen: dict = {}
    out = json.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    pool, server = _serving(200, out, api_key="sk-pool-key", seen=seen)
    try:
        chat(pool, "m", [{"role": "user", "content": "hi"}], 7, {"temperature": 0.2}, task_id="task-1")
    finally:
        server.shutdown()
    assert seen["path"] == "/v1/chat/completions" and seen["auth"] == "Bearer sk-pool-key"
    assert seen["task"] == "task-1"
    assert seen["body"] == {"temperature": 0.2, "model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 7}
