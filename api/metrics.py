"""Prometheus metrics of one API process: its answers by route, method and status, and the queue's
depth (read from Redis at each scrape), served at `/metrics`.

Each process has a registry of its own: scrape every replica (a Kubernetes pod is one process).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ApiMetrics:
    """The metrics one API process keeps."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "respool_http_requests",
            "HTTP answers, by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "respool_queue_depth", "Responses waiting in the queue for a worker.", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every answer when it starts (pure ASGI, so streamed answers pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                # The router has put the matched route in the scope by now; its template, not the
                # path, keeps the label set small (`path_format`: without the convertors' names).
                route = getattr(scope.get("route"), "path_format", "unmatched")
                self.metrics.requests.labels(route, scope["method"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
