"""One attempt's events onto the response's Redis stream (DESIGN.md §3, §7): numbered, appended
under the attempt's lease (fenced), batched while an append is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError

from worker.errors import CancelRequestedError, FencedOutError
from worker.events.lease import Lease
from worker.events.stream import (
    AppendResult,
    Event,
    EventLog,
    Leaving,
    Outcome,
    encode,
    expire_response,
    last_event,
    read_events,
)
from worker.outages import is_outage, patiently
from worker.translation import coalesce, output, replay

log = logging.getLogger("respool.runner")

# Events after which no output has reached a client yet: a new attempt may still generate.
BEFORE_OUTPUT = frozenset({"response.created", "response.queued", "response.in_progress"})

# A deferring writer (`defer`) appends once this many events wait, whether or not it is asked to:
# what it holds in memory stays bounded however long the turn.
DEFERRED_MOST = 512

# Takes a lease an append found gone again, if it may be (`Runtime.reclaim`); whether it did.
type Reclaim = Callable[[Lease], Awaitable[bool]]


class RedisOutlastedError(RedisConnectionError):
    """Redis stayed unreachable past a writer's patience (RESPOOL_REDIS_OUTAGE_SECONDS, for an
    attempt's): the response fails saying so. An outage still (`is_redis_outage`), its cause the
    last error met."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"Redis was unreachable for {seconds:g} s")
        self.seconds = seconds


class ResponseWriter:
    """Numbers one attempt's events and appends them under its lease.

    An append that meets an unreachable Redis is retried for up to `patience` seconds (an
    attempt's: RESPOOL_REDIS_OUTAGE_SECONDS), then raises `RedisOutlastedError`. One fenced out
    asks `reclaim` for its lease once (it may have lapsed during the outage) and goes again if it
    got it.

    `send` does not wait: events sent while an append is in flight go together in the next one,
    their deltas merged (DESIGN.md §7, natural batching), so a fast upstream costs a round trip
    per batch, not per chunk. Its appends are handed to the event log with a callback, not a task
    and a future each (a token's append would cost both). `drain` waits for all of them; a failed
    append is raised by the next `send` or `drain`.
    """

    @classmethod
    def after(
        cls,
        log_: EventLog,
        lease: Lease,
        last: Event | None,
        patience: float = 0.0,
        reclaim: Reclaim | None = None,
    ) -> ResponseWriter:
        """A writer that appends after `last`, the stream's newest event (None: an empty stream)."""
        return cls(log_, lease, next_sequence_after(last), patience, reclaim)

    def __init__(
        self,
        log_: EventLog,
        lease: Lease,
        next_sequence: int,
        patience: float = 0.0,
        reclaim: Reclaim | None = None,
    ) -> None:
        self.log = log_
        self.lease = lease
        self.next_sequence = next_sequence
        self.patience = patience
        # Asked whether a lease an append found gone may be taken again (it lapsed while Redis was
        # unreachable, and no later attempt started): then the append goes again, not fenced.
        self._reclaim = reclaim
        self._reclaimed = False  # the batch in flight has asked for its lease again
        self._reclaiming: asyncio.Task[None] | None = None  # kept while it asks
        self.started_at = time.monotonic()
        self.first_output_at: float | None = None
        self._pending: list[dict[str, Any]] = []
        self._inflight: list[Event] | None = None  # the batch sent and not yet landed
        self._failure: BaseException | None = None  # what the last append met, raised once
        self._idle: asyncio.Future[None] | None = None  # resolved once nothing is in flight
        self._retry_until = 0.0  # while an append meets an outage: until when it is tried again
        self._retry_delay = 0.0
        self._abandoned = False
        self._deferred = False  # appends only when waited on (`defer`)
        self._holding = False  # what is sent waits (`hold`): the upstream's last read
        self._kept = False  # what waits was kept at a turn's end, for the response's end (`end_turn`)

    def defer(self) -> None:
        """Append what is sent only when the writer is waited on (`drain`, `settle`, `emit`), or
        once `DEFERRED_MOST` events wait: for a response no client follows event by event (a
        foreground one not streamed: its create waits for the terminal event alone), whose model
        turn then costs one append where it cost one per batch (a short response's `in_progress`
        went alone, then its output), and its relay one wake-up. A cancel still reaches it (the
        worker's watch of cancel flags); what waits to be appended when its attempt dies is what an
        attempt loses between appends anyway, as the turn had not ended."""
        self._deferred = True

    def hold(self) -> None:
        """Keep what is sent from now on (the upstream's last read: its turn is ending) until the
        writer is waited on: `end_turn` may then keep it for the response's end (`emit(final=True)`)."""
        self._holding = True

    def send(self, events: list[dict[str, Any]]) -> None:
        """Append `events` after those sent before, without waiting (see `drain`)."""
        self._raise_failure()
        self._abandoned = self._kept = False
        self._pending += events
        if self._retry_until and len(self._pending) >= DEFERRED_MOST:
            # Redis is unreachable and the model goes on: what waits is merged as it grows, so it
            # holds the output's text, not an event for every delta of it.
            self._pending = coalesce.merge_deltas(self._pending)
        waits = (self._deferred or self._holding) and len(self._pending) < DEFERRED_MOST
        if self._inflight is None and self._pending and not waits:
            self._submit()

    async def drain(self) -> None:
        """Wait until everything sent has landed; raise what an append met."""
        await self._landing()
        self._raise_failure()

    async def end_turn(self) -> None:
        """A model turn's end: wait until what is in flight has landed, and raise what an append
        met; what waits (the turn's last read) is kept for the response's end, one append with its
        terminal event after its commit (DESIGN.md §4), or for a later `send` (a tool loop's next
        step takes it along). Were that last append lost, the next holder tells what it carried
        from the row (`end_stream`)."""
        await self._flying()
        self._raise_failure()
        self._holding, self._kept = False, True

    async def settle(self) -> None:
        """Wait until what was sent is appended or an append fails, whatever it meets: then
        `next_sequence` is where the stream ends."""
        await self._landing()
        self._failure = None

    async def abandon(self) -> None:
        """Stop appending what was sent (the attempt is over). An append already sent may still land:
        whoever writes next reads where the stream ends (`end_stream`)."""
        self._pending.clear()
        self._abandoned = True
        self._failure = None
        self._holding = self._kept = False

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    async def _landing(self) -> None:
        """Until nothing is in flight (what was sent meanwhile included, what a deferring or holding
        writer keeps too)."""
        keeps = self._deferred or self._holding or self._kept
        self._holding = self._kept = False
        while True:
            if keeps and self._pending and self._inflight is None and self._failure is None:
                self._submit()
            if self._inflight is None:
                return
            if self._idle is None:
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)

    async def _flying(self) -> None:
        """Until the batch in flight, if any, has landed (what waits is not sent: the writer holds)."""
        self._holding = True
        while self._inflight is not None:
            if self._idle is None:
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)

    def _submit(self) -> None:
        events, self._pending = self._pending, []
        if len(events) == 1:  # a token a batch: the steady pace's
            self._inflight = [encode(events[0], self.next_sequence)]
        else:
            events = coalesce.merge_deltas(events)
            self._inflight = [
                encode(event, self.next_sequence + offset) for offset, event in enumerate(events)
            ]
        self._retry_until = 0.0
        self._reclaimed = False
        self.log.submit(self.lease, self._inflight, 0, self._landed)

    def _resubmit(self) -> None:
        if self._inflight is None:
            return
        if self._abandoned:  # given up while it waited to go again: it never landed
            self._inflight = None
            self._wake()
            return
        self.log.submit(self.lease, self._inflight, 0, self._landed)

    def _landed(self, outcome: Outcome) -> None:
        """The event log's word on the batch in flight: count it, or retry it, or keep its failure;
        then send what waits, or tell whoever waits for the writer to be idle."""
        encoded = self._inflight
        assert encoded is not None
        if isinstance(outcome, Exception) and _landed_before(outcome):
            outcome = AppendResult.OK
        if isinstance(outcome, Exception):
            if is_outage(outcome) and not self._abandoned and self._retry(outcome):
                return
            failure: BaseException | None = self._outlasted(outcome) if is_outage(outcome) else outcome
        else:
            if outcome is AppendResult.FENCED and self._may_reclaim():
                self._reclaimed = True
                self._reclaiming = asyncio.get_running_loop().create_task(self._take_again())
                return
            self._counted(encoded)
            failure = None
            if outcome is AppendResult.FENCED:
                failure = FencedOutError(self.lease.response_id)
            elif outcome is AppendResult.CANCEL_REQUESTED:
                failure = CancelRequestedError(self.lease.response_id)
        self._inflight = None
        if self._abandoned:  # what an abandoned writer's last append met is nobody's to hear
            self._pending.clear()
        else:
            self._failure = failure
        if self._failure is None and self._pending and not self._holding:
            self._submit()
            return
        self._wake()

    def _may_reclaim(self) -> bool:
        """Whether a fenced batch may ask for its lease again: once a batch (a lease lost again is
        lost), and not once the attempt is over."""
        return self._reclaim is not None and not self._reclaimed and not self._abandoned

    async def _take_again(self) -> None:
        """The batch in flight was fenced out: send it again if its lease could be taken again,
        else end in the fence."""
        assert self._reclaim is not None
        try:
            again = await self._reclaim(self.lease)
        except Exception as exc:  # Redis again: the batch's outage, retried within its patience
            self._reclaimed = False
            self._landed(exc)
            return
        if again:
            self._resubmit()
        else:
            self._landed(AppendResult.FENCED)

    def _wake(self) -> None:
        """Tell whoever waits for the writer to be idle."""
        if self._idle is not None:
            idle, self._idle = self._idle, None
            if not idle.done():
                idle.set_result(None)

    def _retry(self, outage: Exception) -> bool:
        """Send the batch in flight again after a backoff, within `patience`; False past it."""
        loop = asyncio.get_running_loop()
        if not self._retry_until:
            self._retry_until, self._retry_delay = loop.time() + self.patience, 0.1
        if loop.time() + self._retry_delay > self._retry_until:
            return False
        log.warning(
            "appending to %s met %s; trying again in %.1f s",
            self.lease.response_id,
            outage,
            self._retry_delay,
        )
        loop.call_later(self._retry_delay, self._resubmit)
        self._retry_delay = min(self._retry_delay * 2, 1.0)
        return True

    def _outlasted(self, outage: Exception) -> Exception:
        """What an append that met `outage` past the writer's patience raises: a writer with none
        (the API's, which answers 503 at once) raises the outage itself."""
        if not self.patience or isinstance(outage, RedisOutlastedError):
            return outage
        outlasted = RedisOutlastedError(self.patience)
        outlasted.__cause__ = outage
        return outlasted

    def _counted(self, encoded: list[Event]) -> None:
        """A batch landed: the numbers are used up (only now: a writer that goes on after a failed
        append must leave no gap)."""
        self.next_sequence += len(encoded)
        if self.first_output_at is None and any(_is_output(event) for event in encoded):
            self.first_output_at = time.monotonic()

    async def emit(
        self,
        events: list[dict[str, Any]],
        *,
        final: bool = False,
        retain_seconds: int = 0,
        leaving: Leaving | None = None,
    ) -> None:
        """Append `events`; raise `FencedOutError`, or `CancelRequestedError` (unless this is the
        final append, which carries what the writer keeps before them: `end_turn`, `defer`). With
        `retain_seconds` (a final append), the response's keys are kept that
        long from then on (`expire_response`, in the same round trip); with `leaving`, it leaves its
        queue and its lease is given back in it too (`EventLog.append`)."""
        if final:  # what the writer keeps goes with it, in one append (`end_turn`)
            await self._flying()
            if self._pending:
                events = [*coalesce.merge_deltas(self._pending), *events]
                self._pending = []
            self._holding = self._kept = False
        else:
            await self._landing()  # after what `send` has in flight
        encoded = [encode(event, self.next_sequence + offset) for offset, event in enumerate(events)]
        result = await self._append(encoded, retain_seconds, leaving)
        if result is AppendResult.FENCED and self._reclaim is not None and await self._reclaim(self.lease):
            result = await self._append(encoded, retain_seconds, leaving)
        self._counted(encoded)
        if result is AppendResult.FENCED:
            raise FencedOutError(self.lease.response_id)
        if result is AppendResult.CANCEL_REQUESTED and not final:
            raise CancelRequestedError(self.lease.response_id)

    async def _append(
        self, encoded: list[Event], retain_seconds: int, leaving: Leaving | None
    ) -> AppendResult:
        """One append, tried again while Redis is unreachable, for up to `patience` seconds."""
        once = partial(self._append_once, encoded, retain_seconds, leaving)
        try:
            return await patiently(once, self.patience, first_delay=0.1, max_delay=1.0)
        except Exception as exc:
            if is_outage(exc):
                raise self._outlasted(exc) from exc
            raise

    async def _append_once(
        self, encoded: list[Event], retain_seconds: int, leaving: Leaving | None
    ) -> AppendResult:
        try:
            return await self.log.append(self.lease, encoded, retain_seconds, leaving)
        except RedisResponseError as exc:
            if _landed_before(exc):  # the try that added them did the rest of its step too
                return AppendResult.OK
            raise


def _landed_before(outcome: object) -> bool:
    """Whether an append's error says its events were already there. Explicit entry ids make a
    repeat fail (DESIGN.md §3); the script checked our lease first, so only we can have written
    these numbers: a try whose reply was lost (ours, or the client's own resend after a dropped
    connection) got through."""
    return isinstance(outcome, RedisResponseError) and "equal or smaller" in str(outcome)


def _is_output(event: Event) -> bool:
    """Whether the event tells something the model said (no lifecycle event, no ending)."""
    return event.type not in BEFORE_OUTPUT and not event.is_terminal


def next_sequence_after(last: Event | None) -> int:
    """The number of the event that follows `last` (None: the first)."""
    return 0 if last is None else last.sequence_number + 1


async def end_stream(writer: ResponseWriter, response: dict[str, Any], ttl_seconds: int) -> None:
    """End the stream with `response`'s terminal event unless its newest event already is one; then
    start its retention clock. The writer's lease must be held. What the stream has not told of the
    response's output (an end committed whose last append, the rest of its output with its terminal
    event, was lost) is told first, after what it told (`output.tell_rest`; all of it, when its
    newest event comes before any output: `output.tell_whole`), so the stream adds up to the Response.

    Where the stream ends is read once the writer has settled: an append of its own still in flight
    (an abandoned attempt's) may already be in the stream while its outcome is not yet counted, and
    a newest event read then, counted after, would leave a gap before the terminal event (CI saw
    `... 12, 16` when a cancel raced a response's last batch)."""
    await writer.settle()
    last = await last_event(writer.log.redis, writer.lease.response_id)
    if last is None or not last.is_terminal:
        told: list[dict[str, Any]] = []
        if last is not None:  # an append of another writer's may have landed after this one counted
            writer.next_sequence = next_sequence_after(last)
            items = response.get("output") or []
            if last.type in BEFORE_OUTPUT:  # none of its output told
                told = output.tell_whole(items)
            elif items:  # some told: the rest follows it
                events = await read_events(writer.log.redis, writer.lease.response_id)
                told = output.tell_rest(replay.rebuild(event.payload() for event in events), items)
        await writer.emit([*told, terminal_event(response)], final=True, retain_seconds=ttl_seconds)
    else:
        await expire_response(writer.log.redis, writer.lease.response_id, ttl_seconds)


def terminal_event(response: dict[str, Any]) -> dict[str, Any]:
    """The one terminal event for a finished Response (a cancel ends as `response.failed`, PROTOCOL.md §4.1)."""
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        response["status"], "response.failed"
    )
    return {"type": kind, "response": response}
