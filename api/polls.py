"""The poll (`GET /v1/responses/{id}`, no query: PROTOCOL.md §7), served past FastAPI's routing,
dependencies and middleware (issue 20).

A background response's client polls it every few hundred milliseconds; its answer is one read of
Postgres (`ResponseService.retrieve`). Measured with py-spy, three quarters of an API's CPU for a
poll went to the framework around that read: the middleware stack (ours and FastAPI's own), the
router's walk of its routes, the dependencies' solving, the request and answer objects. Here it is
what the routed poll is, in order: the request id (`RequestIdMiddleware`), the bearer key's owner
(`auth.owner`), the owner's request rate (`routes._count_request`), the read, the answer counted
by route, method and status (`MetricsMiddleware`), every error answered by the app's own handlers
(`errors.answer_for`). Any other GET of a response (a query: `stream`, `starting_after`), and a path
that is not a well-formed response id (its 400 names the parameter), takes the routed way.
"""

from __future__ import annotations

import re
import secrets

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api import errors
from api.encoding import JSONAnswer
from api.metrics import ApiMetrics
from worker import logs
from worker.protocol.request import RESPONSE_ID_PATTERN
from worker.service.responses import ResponseService

PREFIX = "/v1/responses/"
ROUTE = PREFIX + "{response_id}"  # the routed poll's label in the metrics (its `path_format`)
_RESPONSE_ID = re.compile(RESPONSE_ID_PATTERN)
_REQUEST_ID = errors.REQUEST_ID.encode()


def polled_id(scope: Scope) -> str | None:
    """The response id of a plain poll, or None for any other request."""
    if scope["method"] != "GET" or scope["query_string"] or scope.get("root_path"):
        return None
    path: str = scope["path"]
    if not path.startswith(PREFIX):
        return None
    response_id = path[len(PREFIX) :]
    return response_id if _RESPONSE_ID.fullmatch(response_id) else None


async def poll(
    app: FastAPI, metrics: ApiMetrics, scope: Scope, receive: Receive, send: Send, response_id: str
) -> None:
    """Answer the poll of `response_id` as the routed `retrieve_response` would."""
    request_id = f"req_{secrets.token_hex(16)}"
    logs.REQUEST_ID.set(request_id)  # every log line about this request carries it
    scope["app"] = app
    try:
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        owner = app.state.keys.owner_of(None if authorization is None else authorization.decode("latin-1"))
        service: ResponseService = app.state.service
        await service.quotas.check_rate(owner)
        answer: Response = JSONAnswer(await service.retrieve(owner, response_id))
    except Exception as exc:
        answer = await errors.answer_for(app, Request(scope, receive), exc)
    answer.raw_headers.append((_REQUEST_ID, request_id.encode()))
    metrics.requests.labels(ROUTE, "GET", str(answer.status_code)).inc()
    await answer(scope, receive, send)
