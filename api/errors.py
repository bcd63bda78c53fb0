"""Rendering every error in OpenAI's envelope (PROTOCOL.md §5.6), with `x-request-id` on every answer.

Domain errors (`worker.errors`) carry their own status; framework errors are mapped here once.
A 503 says when to come back (`retry-after`, `RESPOOL_RETRY_AFTER_SECONDS`), and so does a 429 (its
own wait); a 503 that follows a recorded create also says not to come back on its own
(`x-should-retry: false`, PROTOCOL.md §5.5). A 408 closes the connection.
"""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.encoding import JSONAnswer
from worker import logs
from worker.errors import (
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    RequestTimeoutError,
    RespoolError,
    UnavailableAfterCommitError,
    UnavailableError,
)
from worker.outages import OUTAGE_CLASSES, as_unavailable

log = logging.getLogger("respool.api")

REQUEST_ID = "x-request-id"


def error_response(error: RespoolError, retry_after_seconds: int | None = None) -> JSONAnswer:
    """The envelope for `error`, with `retry-after` where the client should come back (and
    `x-should-retry: false` where its SDK must not do so by itself)."""
    headers = {}
    if isinstance(error, UnavailableError):
        headers["retry-after"] = str(retry_after_seconds or error.retry_after_seconds)
    if isinstance(error, OverloadedError):
        headers["retry-after"] = str(error.retry_after_seconds)
    if isinstance(error, UnavailableAfterCommitError):
        headers["x-should-retry"] = "false"
    if isinstance(error, RequestTimeoutError):  # what is left of its body will not be read
        headers["connection"] = "close"
    return JSONAnswer(error.to_body(), status_code=error.status, headers=headers)


def committed_error_response(exc: Exception, retry_after_seconds: int | None = None) -> JSONAnswer:
    """An error after a create was committed: never retried, or the SDK would run it twice (PROTOCOL.md §5.5)."""
    if not isinstance(exc, RespoolError):
        log.exception("error while waiting for a committed response")
        exc = UnavailableError("The response was accepted, but waiting for it failed; retrieve it by id.")
    answer = error_response(exc, retry_after_seconds)
    answer.headers["x-should-retry"] = "false"
    return answer


def _retry_after(request: Request) -> int | None:
    seconds: int | None = getattr(request.app.state, "retry_after_seconds", None)
    return seconds


async def _domain(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RespoolError)
    return error_response(exc, _retry_after(request))


async def _validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"][1:]) or None
    return error_response(InvalidRequestError(f"Invalid value for '{param}': {first['msg']}.", param=param))


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFoundError(f"Unknown route: {request.method} {request.url.path}."))
    error = RespoolError(str(exc.detail))
    error.status, error.type = exc.status_code, "invalid_request_error"
    answer = error_response(error)
    answer.headers.update(exc.headers or {})
    if exc.status_code == 405:  # every method of the path (RFC 9110 §15.5.6), not the first route's
        answer.headers["allow"] = ", ".join(_allowed_methods(request))
    return answer


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route that matches the request's path (FastAPI keeps included routers
    as routes of their own, holding theirs in `original_router`)."""
    methods: set[str] = set()
    routes = list(request.app.routes)
    while routes:
        route = routes.pop()
        nested = getattr(route, "original_router", None)
        if nested is not None:
            routes.extend(nested.routes)
        elif isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


async def _outage(request: Request, exc: Exception) -> Response:
    """The one place a backing server's outage becomes a 503 with `retry-after` (worker/outages.py);
    any other error of Redis's or Postgres's is a 500 that the log explains."""
    unavailable = as_unavailable(exc)
    if unavailable is None:
        return await _unexpected(request, exc)
    log.warning("%s %s: %s (%s)", request.method, request.url.path, unavailable.message, type(exc).__name__)
    return error_response(unavailable, _retry_after(request))


async def answer_for(app: FastAPI, request: Request, exc: Exception) -> Response:
    """What the app answers for `exc` raised by a route: its handler's answer (`install`), found
    by the exception's class as Starlette's exception middleware finds it, or the 500 of an
    unexpected error (`RequestIdMiddleware`). For a route served past the framework (api/hot.py)."""
    for cls in type(exc).__mro__:
        handler = app.exception_handlers.get(cls)
        if handler is not None:
            answer = handler(request, exc)  # every handler `install` adds is a coroutine
            return answer if isinstance(answer, Response) else await answer
    return await _unexpected(request, exc)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(RespoolError("The server had an error while processing your request."))


class RequestIdMiddleware:
    """Tag every answer with `x-request-id` (the SDK surfaces it as `request_id`, PROTOCOL.md §5.4),
    and answer an unexpected error with a 500 in OpenAI's envelope. (Starlette's own handler for
    `Exception` answers, then raises the error again to the server, which closes the connection:
    a client could read a reset, not the answer.)

    Pure ASGI: Starlette's `BaseHTTPMiddleware` would pass every chunk of a stream through a memory
    channel and a task of its own, which cost more CPU than relaying the event (seen in profiles).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req_{secrets.token_hex(16)}"
        logs.REQUEST_ID.set(request_id)  # every log line about this request carries it
        header = (REQUEST_ID.encode(), request_id.encode())
        started = False

        async def tagged(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        except Exception as exc:
            if started:  # part of an answer went: the server can only cut it off
                raise
            answer = await _unexpected(Request(scope), exc)
            await answer(scope, receive, tagged)


def install(app: FastAPI, retry_after_seconds: int | None = None) -> None:
    """Render every error (`retry_after_seconds` on each 503; None: the error's own default)."""
    app.state.retry_after_seconds = retry_after_seconds
    app.add_exception_handler(RespoolError, _domain)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(HTTPException, _http)
    for outage in OUTAGE_CLASSES:  # handled inside the middleware, so the answer has its request id
        app.add_exception_handler(outage, _outage)
    app.add_middleware(RequestIdMiddleware)
