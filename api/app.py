"""The FastAPI application: one `ResponseService` per process, opened in the lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api import errors, hot, openapi
from api.auth import Keys
from api.encoding import JSONAnswer
from api.limits import BodyLimitMiddleware
from api.metrics import CONTENT_TYPE, ApiMetrics, MetricsMiddleware
from api.routes import router, websockets
from api.sse import SERVER_SEND
from worker.heap import freeze_startup_heap
from worker.service.responses import ResponseService
from worker.settings import Settings

log = logging.getLogger("respool.api")


class RespoolApp(FastAPI):
    """The app, handing an HTTP request's scope the server's own `send` (`SERVER_SEND`): an event
    stream writes its body frames there, past the middleware's wrappers (api/sse.py). A plain poll
    and a create are served past the framework's routing (api/hot.py)."""

    hot: hot.HotRoutes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
            handler = self.hot.handler(scope)
            if handler is not None:
                await handler(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; nothing connects until the lifespan starts (STYLE.md boundary 3)."""
    settings = settings or Settings()
    keys = Keys(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if keys.is_open:
            log.warning(
                "NO AUTHENTICATION: RESPOOL_API_KEYS is not set, so anyone who can reach this port "
                "can use it, and every response has the same owner. Set RESPOOL_API_KEYS to turn auth on."
            )
        service = ResponseService.open(settings)
        await service.start()
        app.state.service = service
        freeze_startup_heap()  # started: what is alive now lives as long as the process
        try:
            yield
        finally:
            await service.close()

    app = RespoolApp(title="respool", lifespan=lifespan, default_response_class=JSONAnswer)
    app.state.keys = keys
    app.add_middleware(  # inside the request id
        BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_seconds=settings.body_timeout_seconds
    )
    errors.install(app, settings.retry_after_seconds)
    metrics = ApiMetrics()
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.include_router(router)
    app.include_router(websockets)
    app.hot = hot.HotRoutes(app, metrics, settings)
    openapi.install(app, secured=not keys.is_open)

    _install_operations(app, metrics)
    return app


def _install_operations(app: FastAPI, metrics: ApiMetrics) -> None:
    """The routes operators ask, outside /v1: /metrics, /healthz, /readyz."""

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        """This process's Prometheus metrics, with the queue's depth as of now."""
        service: ResponseService = app.state.service
        try:
            metrics.queue_depth.set(await service.queue_depth())
        except Exception:  # Redis unreachable: the rest is still worth scraping
            log.warning("metrics: the queue depth could not be read")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get(
        "/healthz", responses={200: {"description": "Success", "content": openapi.READY[200]["content"]}}
    )
    async def healthz() -> dict[str, str]:
        """The process is alive (whatever Redis and Postgres are doing)."""
        return {"status": "ok"}

    @app.get("/readyz", responses=openapi.READY)
    async def readyz() -> dict[str, str]:
        """Redis and Postgres both answer; a 503 with `retry-after` while either does not.

        For monitoring: every replica shares them, so gating traffic on it would turn an outage's
        503s (which tell clients when to retry) into refused connections.
        """
        service: ResponseService = app.state.service
        await service.check_ready()
        return {"status": "ok"}
