"""The SSE relay (PROTOCOL.md §5.3): `event:` + one-line `data:` + blank line, no `id:` lines,
comment heartbeats during silences so idle connections survive proxies. Also noticing a client
that goes away, so a foreground response it abandoned can be cancelled (DESIGN.md §2).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from worker.events import Event

log = logging.getLogger("respool.sse")

HEARTBEAT = b": keepalive\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

# Clean-ups started from a cancelled stream run as tasks of their own; keep them referenced.
_CLEANUPS: set[asyncio.Task[None]] = set()


def frame(event: Event) -> bytes:
    """One SSE frame, from the event's stored bytes (encoded once, DESIGN.md §7)."""
    return b"event: " + event.type.encode() + b"\ndata: " + event.data + b"\n\n"


async def _frames(
    events: AsyncIterator[Event | None], on_disconnect: Callable[[], Awaitable[None]] | None
) -> AsyncIterator[bytes]:
    is_ended = False
    try:
        async for event in events:
            yield HEARTBEAT if event is None else frame(event)
            is_ended = event is not None and event.is_terminal
    finally:
        if not is_ended and on_disconnect is not None:
            # The client went away mid-stream. This task is being cancelled, so the clean-up runs
            # as a task of its own that the cancellation cannot reach.
            _run_detached(on_disconnect())


def _run_detached(cleanup: Awaitable[None]) -> None:
    async def run() -> None:
        try:
            await cleanup
        except Exception:
            log.exception("clean-up after a client went away failed")

    task = asyncio.get_running_loop().create_task(run())
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)


def sse_response(
    events: AsyncIterator[Event | None], on_disconnect: Callable[[], Awaitable[None]] | None = None
) -> StreamingResponse:
    """Relay `events`; `on_disconnect` runs if the client goes away before the terminal event."""
    return StreamingResponse(_frames(events, on_disconnect), media_type="text/event-stream", headers=HEADERS)


async def until_disconnected[T](request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnects first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next message is the disconnect, whenever it comes.
    while (await request.receive())["type"] != "http.disconnect":
        pass
