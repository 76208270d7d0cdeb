"""Request body size limit (settings.max_request_bytes) and JSON nesting limit
(settings.max_json_depth), enforced before the
body is parsed: an ASGI middleware answering 413 RequestTooLarge at once when
Content-Length is over the limit, else as soon as the bytes received (chunked
or streamed) pass it.  It sits inside AuthMiddleware, so an unauthenticated
oversized request still gets 401."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway_tasks.core.errors import ApiError
from gateway_tasks.core.json_limits import json_depth, too_deep_message
from gateway_tasks.rest.errors import api_error_response


class BodySizeLimit:
    """Reads the whole body (at most max_bytes) before the app does, measures its JSON
    nesting on the bytes (over max_depth: 400, before any parser recurses into it), then
    hands it on as one message."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int, upload_bytes: int = 0,
                 upload_path: str = "/v1/files"):
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        # an upload (POST /v1/files, the Batch API) has its own, larger limit
        self.upload_bytes, self.upload_path = upload_bytes, upload_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.upload_bytes and scope.get("path") == self.upload_path and scope.get("method") == "POST":
            await BodySizeLimit(self.app, max(self.max_bytes, self.upload_bytes), self.max_depth)(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if json_depth(raw, self.max_depth) > self.max_depth:
            exc = ApiError(400, "InvalidRequest", too_deep_message(self.max_depth),
                           max_json_depth=self.max_depth)
            await api_error_response(exc)(scope, receive, send)
            return
        body: Message | None = {"type": "http.request", "body": raw, "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        exc = ApiError(413, "RequestTooLarge",
                       f"request body is over the limit of {self.max_bytes} bytes (max_request_bytes)",
                       max_request_bytes=self.max_bytes)
        await api_error_response(exc)(scope, receive, send)
