"""One attempt's events onto the response's Redis stream (DESIGN.md §3, §7): numbered, appended
under the attempt's lease (fenced), batched while an append is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial
from typing import Any

from redis.exceptions import ResponseError as RedisResponseError

from worker.errors import CancelRequestedError, FencedOutError
from worker.events.lease import Lease
from worker.events.stream import AppendResult, Event, EventLog, encode, expire_response
from worker.outages import patiently
from worker.translation import coalesce

log = logging.getLogger("respool.runner")

# Events after which no output has reached a client yet: a new attempt may still generate.
BEFORE_OUTPUT = frozenset({"response.created", "response.queued", "response.in_progress"})


class ResponseWriter:
    """Numbers one attempt's events and appends them under its lease.

    An append that meets an unreachable Redis is retried for up to `patience` seconds (the lease's
    time to live: past it the lease is gone and the append would be fenced anyway).

    `send` does not wait: events sent while an append is in flight go together in the next one,
    their deltas merged (DESIGN.md §7, natural batching), so a fast upstream costs a round trip
    per batch, not per chunk. `drain` waits for all of them; a failed append is raised by the next `send` or `drain`.
    """

    @classmethod
    def after(cls, log_: EventLog, lease: Lease, last: Event | None, patience: float = 0.0) -> ResponseWriter:
        """A writer that appends after `last`, the stream's newest event (None: an empty stream)."""
        return cls(log_, lease, next_sequence_after(last), patience)

    def __init__(self, log_: EventLog, lease: Lease, next_sequence: int, patience: float = 0.0) -> None:
        self.log = log_
        self.lease = lease
        self.next_sequence = next_sequence
        self.patience = patience
        self.started_at = time.monotonic()
        self.first_output_at: float | None = None
        self._pending: list[dict[str, Any]] = []
        self._flushing: asyncio.Task[None] | None = None

    def send(self, events: list[dict[str, Any]]) -> None:
        """Append `events` after those sent before, without waiting (see `drain`)."""
        if self._flushing is not None and self._flushing.done():
            flushed, self._flushing = self._flushing, None
            flushed.result()  # raise what the last append met
        self._pending += events
        if self._flushing is None and self._pending:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def drain(self) -> None:
        """Wait until everything sent has landed; raise what an append met."""
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            await flushing

    async def settle(self) -> None:
        """Wait until what was sent is appended or an append fails, whatever it meets: then
        `next_sequence` is where the stream ends."""
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            with contextlib.suppress(Exception):
                await flushing

    async def abandon(self) -> None:
        """Stop appending what was sent (the attempt is over). An append already sent may still land:
        whoever writes next reads where the stream ends (`_ensure_terminal`)."""
        self._pending.clear()
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            flushing.cancel()
            with contextlib.suppress(BaseException):
                await flushing

    async def _flush(self) -> None:
        while self._pending:
            events, self._pending = coalesce.merge_deltas(self._pending), []
            await self.emit(events)

    async def emit(
        self, events: list[dict[str, Any]], *, final: bool = False, retain_seconds: int = 0
    ) -> None:
        """Append `events`; raise `FencedOutError`, or `CancelRequestedError` (unless this is the
        final append). With `retain_seconds` (a final append), the response's keys are kept that
        long from then on (`expire_response`, in the same round trip)."""
        encoded = [encode(event, self.next_sequence + offset) for offset, event in enumerate(events)]
        result = await self._append(encoded, retain_seconds)
        # Only once they landed: a writer that goes on after a failed append must leave no gap.
        self.next_sequence += len(encoded)
        if self.first_output_at is None and any(_is_output(event) for event in encoded):
            self.first_output_at = time.monotonic()
        if result is AppendResult.FENCED:
            raise FencedOutError(self.lease.response_id)
        if result is AppendResult.CANCEL_REQUESTED and not final:
            raise CancelRequestedError(self.lease.response_id)

    async def _append(self, encoded: list[Event], retain_seconds: int) -> AppendResult:
        """One append, tried again while Redis is unreachable, for up to `patience` seconds."""
        return await patiently(
            partial(self._append_once, encoded, retain_seconds), self.patience, first_delay=0.1, max_delay=1.0
        )

    async def _append_once(self, encoded: list[Event], retain_seconds: int) -> AppendResult:
        try:
            return await self.log.append(self.lease, encoded, retain_seconds)
        except RedisResponseError as exc:
            # Explicit entry ids make a repeat fail (DESIGN.md §3). The script checked our lease
            # first, so only we can have written these numbers: a try whose reply was lost (ours,
            # or the client's own resend after a dropped connection) got through.
            if "equal or smaller" in str(exc):
                return AppendResult.OK
            raise


def _is_output(event: Event) -> bool:
    """Whether the event tells something the model said (no lifecycle event, no ending)."""
    return event.type not in BEFORE_OUTPUT and not event.is_terminal


def next_sequence_after(last: Event | None) -> int:
    """The number of the event that follows `last` (None: the first)."""
    return 0 if last is None else last.sequence_number + 1


async def end_stream(
    writer: ResponseWriter, response: dict[str, Any], last: Event | None, ttl_seconds: int
) -> None:
    """End the stream with `response`'s terminal event unless `last`, its newest event, already is
    one; then start its retention clock. The writer's lease must be held."""
    if last is None or not last.is_terminal:
        if last is not None:  # an append of an abandoned batch may have landed after the writer counted
            writer.next_sequence = next_sequence_after(last)
        await writer.emit([terminal_event(response)], final=True, retain_seconds=ttl_seconds)
    else:
        await expire_response(writer.log.redis, writer.lease.response_id, ttl_seconds)


def terminal_event(response: dict[str, Any]) -> dict[str, Any]:
    """The one terminal event for a finished Response (a cancel ends as `response.failed`, PROTOCOL.md §4.1)."""
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        response["status"], "response.failed"
    )
    return {"type": kind, "response": response}
