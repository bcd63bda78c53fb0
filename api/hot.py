"""The hot routes served past FastAPI's routing and dependencies: a plain poll
(`GET /v1/responses/{id}`, no query) and a create (`POST /v1/responses`, no query).

A background response's client polls it every few hundred milliseconds; its answer is one read of
Postgres (`ResponseService.retrieve`). Measured with py-spy, three quarters of an API's CPU for a
poll went to the framework around that read: the middleware stack (ours and FastAPI's own), the
router's walk of its routes, the dependencies' solving, the request and answer objects. A create
spent the same around its own work.

Each goes through the app's own middleware (the metrics, the request id, the body limits), then
what the router and the dependencies did for it: the bearer key's owner (`auth.owner`), the owner's
request rate (`routes.count_request`), the routed function itself (`routes.create_response`,
`routes.retrieve_response`), every error answered by the app's own handlers (`errors.answer_for`,
as Starlette's exception middleware finds them). What is skipped is FastAPI's: the router's walk of
its routes, the dependencies' solving, its own middleware layers. Any other request, a query on
either path, and a poll of a path that is not a well-formed response id (its 400 names the
parameter), takes the routed way.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from functools import partial

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from api import errors, routes
from api.auth import owner
from api.errors import RequestIdMiddleware
from api.limits import BodyLimitMiddleware
from api.metrics import ApiMetrics, MetricsMiddleware
from worker.protocol.request import RESPONSE_ID_PATTERN
from worker.settings import Settings

CREATE = "/v1/responses"
PREFIX = CREATE + "/"
_RESPONSE_ID = re.compile(RESPONSE_ID_PATTERN)

# A routed function's answer to a request, given its owner.
type Answer = Callable[[Request, str], Awaitable[Response]]


class HotRoutes:
    """What `RespoolApp` hands the hot requests to."""

    def __init__(self, app: FastAPI, metrics: ApiMetrics, settings: Settings) -> None:
        self.app = app

        def served(name: str, answer: Answer) -> ASGIApp:
            """The route `name` (its object: the metrics label it by its template) answered by
            `answer`, through the middleware the app has, outermost first, as the app's."""
            run = partial(self._run, _route_named(routes.router.routes, name), answer)
            limited = BodyLimitMiddleware(
                run, max_bytes=settings.max_body_bytes, timeout_seconds=settings.body_timeout_seconds
            )
            return MetricsMiddleware(RequestIdMiddleware(limited), metrics=metrics)

        self._create = served("create_response", routes.create_response)
        self._poll = served("retrieve_response", _retrieve)

    def handler(self, scope: Scope) -> ASGIApp | None:
        """Who serves this HTTP request past the framework, if anyone."""
        if scope["query_string"] or scope.get("root_path"):
            return None
        method, path = scope["method"], scope["path"]
        if method == "POST" and path == CREATE:
            return self._create
        if method == "GET" and path.startswith(PREFIX) and _RESPONSE_ID.fullmatch(path[len(PREFIX) :]):
            return self._poll
        return None

    async def _run(
        self, route: BaseRoute, answer: Answer, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """What the router and the dependencies did for `route`: the owner, the rate, the answer."""
        scope["app"], scope["route"] = self.app, route
        request = Request(scope, receive)
        try:
            caller = await owner(request)
            await routes.count_request(request, caller)
            reply = await answer(request, caller)
        except Exception as exc:
            reply = await errors.answer_for(self.app, request, exc)
        await reply(scope, receive, send)


async def _retrieve(request: Request, caller: str) -> Response:
    """The routed poll, for the response its path names (a plain poll: no stream, no cursor)."""
    return await routes.retrieve_response(request, request.scope["path"][len(PREFIX) :], caller)


def _route_named(routed: list[BaseRoute], name: str) -> BaseRoute:
    for route in routed:
        if getattr(route, "name", None) == name:
            return route
    raise LookupError(f"no route named {name!r}")
