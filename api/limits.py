"""The request-size limit, enforced as the body arrives (pure ASGI, before any route reads it).

A declared `content-length` over the limit is refused at once; a chunked body is counted as it is
received, and the read that crosses the limit raises `RequestTooLargeError` inside the route, which
renders it (413, OpenAI's envelope) like any domain error. Nothing past the limit is buffered.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from worker.errors import RequestTooLargeError


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await error_response(RequestTooLargeError(self.max_bytes))(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLargeError(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (uvicorn) refuses a malformed length itself
    return None
