"""Talking to upstream model servers over HTTP: Chat Completions and Responses, always streamed.

Errors are mapped once, here, into `UpstreamError` (the httpx habit of mapping foreign exceptions at
the boundary).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from worker.routing import Route


class UpstreamError(Exception):
    """The upstream refused or broke the request; `status` is its HTTP status, if it answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def create_client(timeout_seconds: float, max_connections: int) -> httpx.AsyncClient:
    """One pooled client per worker process."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_seconds, connect=10.0), limits=limits)


async def stream_json(
    client: httpx.AsyncClient, route: Route, path: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """POST `body` to `route.base_url + path` and yield each SSE `data:` payload as JSON."""
    headers = {"accept": "text/event-stream"}
    key = route.api_key()
    if key:
        headers["authorization"] = f"Bearer {key}"
    try:
        async with client.stream(
            "POST", route.base_url + path, content=orjson.dumps(body), headers=headers
        ) as reply:
            if reply.status_code >= 400:
                raise UpstreamError(await _error_message(reply), reply.status_code)
            async for line in reply.aiter_lines():
                payload = _data(line)
                if payload is not None:
                    yield payload
    except httpx.HTTPError as exc:
        raise UpstreamError(f"the upstream at {route.base_url} failed: {exc!r}") from exc


def _data(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:"):
        return None
    text = line[5:].strip()
    if not text or text == "[DONE]":
        return None
    try:
        payload = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"the upstream sent a line that is not JSON: {text[:200]!r}") from exc
    if not isinstance(payload, dict):
        raise UpstreamError(f"the upstream sent a JSON value that is not an object: {text[:200]!r}")
    if payload.get("error"):
        raise UpstreamError(f"the upstream reported an error: {_message_of(payload)}")
    return payload


async def _error_message(reply: httpx.Response) -> str:
    body = (await reply.aread())[:2000]
    try:
        message = _message_of(orjson.loads(body))
    except orjson.JSONDecodeError:
        message = body.decode(errors="replace")
    return f"the upstream answered {reply.status_code}: {message}"


def _message_of(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
    return str(payload)[:500]
