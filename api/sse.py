"""The SSE relay (PROTOCOL.md §5.3): `event:` + one-line `data:` + blank line, no `id:` lines,
comment heartbeats during silences so idle connections survive proxies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from worker.events import Event

HEARTBEAT = b": keepalive\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def frame(event: Event) -> bytes:
    """One SSE frame, from the event's stored bytes (encoded once, DESIGN.md §7)."""
    return b"event: " + event.type.encode() + b"\ndata: " + event.data + b"\n\n"


async def _frames(events: AsyncIterator[Event | None]) -> AsyncIterator[bytes]:
    async for event in events:
        yield HEARTBEAT if event is None else frame(event)


def sse_response(events: AsyncIterator[Event | None]) -> StreamingResponse:
    return StreamingResponse(_frames(events), media_type="text/event-stream", headers=HEADERS)
