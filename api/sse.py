"""The SSE relay (PROTOCOL.md §5.3): `event:` + one-line `data:` + blank line, no `id:` lines,
comment heartbeats during silences so idle connections survive proxies. Also noticing a client
that goes away, so a foreground response it abandoned can be cancelled (DESIGN.md §2), and ending
a stream whose events became unavailable (Redis lost) with a fatal `error` event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import StreamingResponse

from worker.errors import UnavailableError
from worker.events import Event

log = logging.getLogger("respool.sse")

HEARTBEAT = b": keepalive\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

# Clean-ups started from a cancelled stream run as tasks of their own; keep them referenced.
_CLEANUPS: set[asyncio.Task[None]] = set()


def frame(event: Event) -> bytes:
    """One SSE frame, from the event's stored bytes (encoded once, DESIGN.md §7)."""
    return b"event: " + event.type.encode() + b"\ndata: " + event.data + b"\n\n"


def error_frame(error: UnavailableError, after: int) -> bytes:
    """The fatal `error` event (flat, PROTOCOL.md §4.1, §4.2) that ends a stream whose events became
    unavailable after sequence number `after`; it says where to resume. It is no event of the
    response's own, so it repeats the last number the client got: a client that resumes after the
    last number it saw (PROTOCOL.md §0.2, the cursor) then misses nothing."""
    resume = "stream=true" if after < 0 else f"stream=true&starting_after={after}"
    message = (
        "The event stream was interrupted because its store (Redis) is unavailable; this alone does "
        f"not end the response. Retrieve it shortly, or resume its events with {resume}."
    )
    event = {
        "type": "error",
        "code": error.code,
        "message": message,
        "param": None,
        "sequence_number": after,
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


async def _frames(
    events: AsyncIterator[Event | None], after: int, on_disconnect: Callable[[], Awaitable[None]] | None
) -> AsyncIterator[bytes]:
    is_ended = False  # whether the client saw the stream's end (so it did not go away)
    try:
        async for event in events:
            yield HEARTBEAT if event is None else frame(event)
            if event is not None:
                after, is_ended = event.sequence_number, event.is_terminal
    except UnavailableError as error:
        is_ended = True  # we end it, not the client: nothing to cancel
        log.warning("a stream ends early after event %d: %s", after, error.message)
        if after >= 0:  # with no event sent yet there is no number to repeat: the stream just ends
            yield error_frame(error, after)
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
    events: AsyncIterator[Event | None],
    after: int = -1,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> StreamingResponse:
    """Relay `events` (those after sequence number `after`); `on_disconnect` runs if the client goes
    away before the terminal event."""
    frames = _frames(events, after, on_disconnect)
    return StreamingResponse(frames, media_type="text/event-stream", headers=HEADERS)


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
