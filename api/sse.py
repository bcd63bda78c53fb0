"""The SSE relay (PROTOCOL.md §5.3): `event:` + one-line `data:` + blank line, no `id:` lines,
comment heartbeats during silences so idle connections survive proxies. Also noticing a client
that goes away, so a foreground response it abandoned can be cancelled (DESIGN.md §2), and ending
a stream whose events became unavailable with a fatal `error` event: Redis unreachable longer
than RESPOOL_REDIS_OUTAGE_SECONDS (a shorter outage only pauses a stream, its heartbeats going on:
worker/service/tailer.py), or back without the stream's events.

A client that stops reading is given up on: a write it leaves untaken for
`RESPOOL_SSE_WRITE_TIMEOUT_SECONDS` (the server's buffers full) ends the stream as a disconnect
does. However a stream ends, its `on_close` runs (it gives back the stream's slot).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from functools import partial

import orjson
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from worker.errors import UnavailableError
from worker.events.stream import Event
from worker.outages import as_unavailable
from worker.service.tail_outage import TailLostError
from worker.service.tailer import Passthrough

log = logging.getLogger("respool.sse")

HEARTBEAT = b": keepalive\n\n"
# Where the app puts the server's own `send` in a request's scope (api/app.py, `RespoolApp`).
SERVER_SEND = "respool.server_send"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

# Clean-ups started from a cancelled stream run as tasks of their own; keep them referenced.
_CLEANUPS: set[asyncio.Task[None]] = set()


def frame(event: Event) -> bytes:
    """One SSE frame, from the event's stored bytes (encoded once, DESIGN.md §7)."""
    return b"event: " + event.type.encode() + b"\ndata: " + event.data + b"\n\n"


def error_frame(error: UnavailableError, after: int, lost: TailLostError | None = None) -> bytes:
    """The fatal `error` event (flat, PROTOCOL.md §4.1, §4.2) that ends a stream whose events became
    unavailable after sequence number `after` (`lost`: the tail says why); it says where to resume,
    unless its events are gone. It is no event of the response's own, so it repeats the last number
    the client got: a client that resumes after the last number it saw (PROTOCOL.md §0.2, the
    cursor) misses nothing."""
    if lost is not None and not lost.is_resumable:
        message = f"{lost} The event stream ends here; retrieve the response by id."
    else:
        resume = "stream=true" if after < 0 else f"stream=true&starting_after={after}"
        why = "Its store (Redis) is unavailable." if lost is None else str(lost)
        message = (
            f"The event stream was interrupted. {why} This alone does not end the response. "
            f"Retrieve it shortly, or resume its events with {resume}."
        )
    event = {
        "type": "error",
        "code": error.code,
        "message": message,
        "param": None,
        "sequence_number": after,
    }
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


class SlowClientError(Exception):
    """The client left a write untaken past the write timeout."""


def _run_detached(cleanup: Awaitable[None]) -> None:
    async def run() -> None:
        try:
            await cleanup
        except Exception:
            log.exception("clean-up after a client went away failed")

    task = asyncio.get_running_loop().create_task(run())
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)


class _WriteWatch:
    """Gives up on a client that leaves one write untaken for `timeout_seconds`, by cancelling the
    write. One timer a stream, re-armed at each deadline, never one a write (DESIGN.md §7)."""

    def __init__(self, timeout_seconds: float) -> None:
        self._timeout = timeout_seconds
        self._loop = asyncio.get_running_loop()
        self.since: float | None = None  # when the write under way began
        self.writer: asyncio.Task[object] | None = None
        self.is_expired = False
        self._timer = self._loop.call_later(timeout_seconds, self._check)

    def _check(self) -> None:
        since, now = self.since, self._loop.time()
        if since is not None and now - since >= self._timeout and self.writer is not None:
            self.is_expired = True
            self.writer.cancel()
            return
        self._timer = self._loop.call_at((now if since is None else since) + self._timeout, self._check)

    def stop(self) -> None:
        self._timer.cancel()


class EventStream(StreamingResponse):
    """An SSE response that gives up on a client that stops reading, and runs `on_close` however it
    ends: completed, the client gone or too slow, or an error.

    Its body is written here, an event a frame, with no generator of frames between the events and
    the writes and no wrapper around each write (each was a hop a token). The start of the
    answer goes through the middleware (its request id, its count in the metrics); its body frames
    straight to the server's `send` (`SERVER_SEND`), past the five wrappers that only look at a
    start: a layer less a token. A live event that comes while the relay waits is written from the
    tailer's read itself, as `send` would write it (`passthrough`, `_through`): no task wakes up
    for it, nor does a queue take it (paired, 30 streams: the API's CPU a token 98 -> 79 µs)."""

    def __init__(
        self,
        events: AsyncIterator[Event | None],
        after: int,
        write_timeout_seconds: float,
        on_disconnect: Callable[[], Awaitable[None]] | None,
        on_close: Callable[[], Awaitable[None]] | None,
        passthrough: Passthrough | None = None,
    ) -> None:
        super().__init__(_no_body(), media_type="text/event-stream", headers=HEADERS)
        self._events = events
        self._passthrough = passthrough
        self._written_through = -1  # the last event written through (`_through`)
        self._after = after
        self._write_timeout = write_timeout_seconds
        self._on_disconnect = on_disconnect
        self._on_close = on_close
        self._is_ended = False  # whether the client saw the stream's end (so it did not go away)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send = self._server_send or send
        passthrough, cycle = self._passthrough, _cycle_of(send)
        if passthrough is not None and cycle is not None:
            passthrough.write = partial(self._through, cycle)
        watch = _WriteWatch(self._write_timeout)
        watch.writer = asyncio.current_task()
        loop = asyncio.get_running_loop()
        after = self._after
        try:
            try:
                async for event in self._events:
                    body = HEARTBEAT if event is None else frame(event)
                    watch.since = loop.time()
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    watch.since = None
                    if event is not None:
                        after, self._is_ended = event.sequence_number, event.is_terminal
            except asyncio.CancelledError:
                if not watch.is_expired:
                    raise
                assert watch.writer is not None
                watch.writer.uncancel()  # the cancel was ours, not the server's: undo it
                raise SlowClientError from None
            except Exception as exc:
                # The relay's boundary: an outage of Redis ends the stream with an error event saying so.
                error = as_unavailable(exc)
                if error is None:
                    raise
                self._is_ended = True  # we end it, not the client: nothing to cancel
                after = max(after, self._written_through)
                lost = exc if isinstance(exc, TailLostError) else None
                log.warning("a stream ends early after event %d: %s", after, lost or error.message)
                if after >= 0:  # with no event sent yet there is no number to repeat: the stream just ends
                    body = error_frame(error, after, lost)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            watch.stop()
            if passthrough is not None:
                passthrough.write = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _through(self, cycle: RequestResponseCycle, event: Event) -> bool:
        """Write `event`'s frame as a chunk of the answer straight to the connection (the tailer's
        read calls this: `Passthrough`), as uvicorn's `send` would: unless its writes are paused
        (a client slow to read: then `send` waits, under the write watch) or the client is gone."""
        transport = cycle.transport
        if cycle.flow.write_paused or cycle.disconnected or transport.is_closing():
            return False
        body = frame(event)
        try:
            transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        except Exception:
            return False
        self._written_through = event.sequence_number
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._server_send: Send | None = scope.get(SERVER_SEND)
        try:
            await super().__call__(scope, receive, send)
        except SlowClientError:
            log.warning(
                "a stream's client took no data for %g s (RESPOOL_SSE_WRITE_TIMEOUT_SECONDS): the stream "
                "is given up, and uvicorn closes its connection (it reports the response incomplete)",
                self._write_timeout,
            )
        finally:
            if isinstance(self._events, AsyncGenerator):
                await self._events.aclose()
            if not self._is_ended and self._on_disconnect is not None:
                # The client went away mid-stream. This task may be being cancelled, so the clean-up
                # runs as a task of its own that the cancellation cannot reach.
                _run_detached(self._on_disconnect())
            if self._on_close is not None:
                _run_detached(self._on_close())


def _cycle_of(send: Send) -> RequestResponseCycle | None:
    """The uvicorn request whose `send` this is, if its body goes chunked on httptools' protocol
    (the server respool runs: api/serving.py), which `EventStream._through` writes as `send` does."""
    cycle = getattr(send, "__self__", None)
    if isinstance(cycle, RequestResponseCycle) and cycle.chunked_encoding is True:
        return cycle
    return None


async def _no_body() -> AsyncGenerator[bytes]:
    """StreamingResponse's body, unused: `EventStream` writes its own."""
    return
    yield b""


def sse_response(
    events: AsyncIterator[Event | None],
    after: int = -1,
    *,
    write_timeout_seconds: float,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_close: Callable[[], Awaitable[None]] | None = None,
    passthrough: Passthrough | None = None,
) -> EventStream:
    """Relay `events` (those after sequence number `after`); `on_disconnect` runs if the client goes
    away (or is given up on) before the terminal event, `on_close` however the stream ends."""
    return EventStream(events, after, write_timeout_seconds, on_disconnect, on_close, passthrough)


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
