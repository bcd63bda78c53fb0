"""Limits on how a request body arrives (pure ASGI, enforced as it is received, before any route
reads it): its size and its time.

A declared `content-length` over the size limit is refused at once; a chunked body is counted as it
is received, and the read that crosses the limit raises `RequestTooLargeError` inside the route,
which renders it (413, OpenAI's envelope) like any domain error. Nothing past the limit is buffered.

A body must have arrived within the body timeout of the request's start: a client that stalls or
trickles it gets `RequestTimeoutError` the same way (408, and the connection is closed), so it
cannot hold a connection and a task open indefinitely. Once the body is in, the time is up to the
route (a foreground request may wait minutes for its response).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from worker.errors import RequestTimeoutError, RequestTooLargeError


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_seconds: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_seconds = timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await error_response(RequestTooLargeError(self.max_bytes))(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_seconds
        received, is_complete = 0, False

        async def counted() -> Message:
            nonlocal received, is_complete
            if is_complete:  # only the disconnect is left to come, whenever it does
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeoutError(self.timeout_seconds) from None
            is_complete = message["type"] != "http.request" or not message.get("more_body", False)
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
