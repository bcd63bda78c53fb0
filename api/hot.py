"""The hot routes served past FastAPI's routing and dependencies (issue 20): a plain poll
(`GET /v1/responses/{id}`, no query) and a create (`POST /v1/responses`, no query).

A background response's client polls it every few hundred milliseconds; its answer is one read of
Postgres (`ResponseService.retrieve`). Measured with py-spy, three quarters of an API's CPU for a
poll went to the framework around that read: the middleware stack (ours and FastAPI's own), the
router's walk of its routes, the dependencies' solving, the request and answer objects. A create
spent the same around its own work.

Each does here what its routed way does, in order: the request id (`RequestIdMiddleware`), the
bearer key's owner (`auth.owner`), the owner's request rate (`routes._count_request`), the route's
own work, the answer counted by route, method and status (`MetricsMiddleware`), every error answered
by the app's own handlers (`errors.answer_for`). A create's body comes through the body limits
(`BodyLimitMiddleware`) and the route itself runs (`routes.create_response`), past the router and
the dependencies only. Any other request, a query on either path, and a poll of a path that is not a
well-formed response id (its 400 names the parameter), takes the routed way.
"""

from __future__ import annotations

import re
import secrets

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from api import errors, routes
from api.encoding import JSONAnswer
from api.errors import RequestIdMiddleware
from api.limits import BodyLimitMiddleware
from api.metrics import ApiMetrics, MetricsMiddleware
from worker import logs
from worker.protocol.request import RESPONSE_ID_PATTERN
from worker.service.responses import ResponseService
from worker.settings import Settings

CREATE = "/v1/responses"
PREFIX = CREATE + "/"
ROUTE = PREFIX + "{response_id}"  # the routed poll's label in the metrics (its `path_format`)
_RESPONSE_ID = re.compile(RESPONSE_ID_PATTERN)
_REQUEST_ID = errors.REQUEST_ID.encode()


class HotRoutes:
    """What `RespoolApp` hands the hot requests to."""

    def __init__(self, app: FastAPI, metrics: ApiMetrics, settings: Settings) -> None:
        self.app = app
        self.metrics = metrics
        # The routed create's own route object: the metrics label it by its template.
        self._create_route = _route_named(routes.router.routes, "create_response")
        # The create's way through what it needs of the middleware: outermost first, as the app's.
        self._create = MetricsMiddleware(
            RequestIdMiddleware(
                BodyLimitMiddleware(
                    self._run_create,
                    max_bytes=settings.max_body_bytes,
                    timeout_seconds=settings.body_timeout_seconds,
                )
            ),
            metrics=metrics,
        )

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

    async def _poll(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer the poll as the routed `retrieve_response` would."""
        request_id = f"req_{secrets.token_hex(16)}"
        logs.REQUEST_ID.set(request_id)  # every log line about this request carries it
        scope["app"] = self.app
        try:
            service = await self._admitted(scope)
            response_id = scope["path"][len(PREFIX) :]
            answer: Response = JSONAnswer(await service.retrieve(scope["respool.owner"], response_id))
        except Exception as exc:
            answer = await errors.answer_for(self.app, Request(scope, receive), exc)
        answer.raw_headers.append((_REQUEST_ID, request_id.encode()))
        self.metrics.requests.labels(ROUTE, "GET", str(answer.status_code)).inc()
        await answer(scope, receive, send)

    async def _run_create(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The routed create's own function, past the router and its dependencies (inside the
        middleware `self._create` wraps it in)."""
        scope["app"], scope["route"] = self.app, self._create_route
        request = Request(scope, receive)
        try:
            await self._admitted(scope)
            answer = await routes.create_response(request, scope["respool.owner"])
        except Exception as exc:
            answer = await errors.answer_for(self.app, request, exc)
        await answer(scope, receive, send)

    async def _admitted(self, scope: Scope) -> ResponseService:
        """The service, once the request's key has an owner (put in the scope) whose rate allows it."""
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        owner = self.app.state.keys.owner_of(
            None if authorization is None else authorization.decode("latin-1")
        )
        scope["respool.owner"] = owner
        service: ResponseService = self.app.state.service
        await service.quotas.check_rate(owner)
        return service


def _route_named(routed: list[BaseRoute], name: str) -> BaseRoute:
    for route in routed:
        if getattr(route, "name", None) == name:
            return route
    raise LookupError(f"no route named {name!r}")
