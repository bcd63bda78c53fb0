"""Following response streams: replay with XRANGE, then one multiplexed XREAD per process (DESIGN.md §7).

A single task blocks in `XREAD` over every stream this process relays, plus a private wake-up
stream: a new subscriber XADDs to it, so the blocked read returns and the next one includes the
new stream. Each subscriber resumes from the exact id it has (never `$`), so no event is lost
between the replay and the live tail.

A read that fails because Redis is unreachable ends nobody: subscribers wait, for up to
`outage_seconds`, and continue from their cursors once it answers; a stream Redis lost ends its
subscribers (worker/service/tail_outage.py). Any other failed read ends every subscriber at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Final

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from worker.connections import HeldConnection, HeldConnections
from worker.events.stream import (
    Event,
    decode_flat,
    entry_id,
    last_event,
    read_events,
    read_events_observed,
)
from worker.keys import events_key, wake_key
from worker.outages import is_redis_outage
from worker.service import tail_outage
from worker.service.tail_outage import LOST, TailLostError

log = logging.getLogger("respool.tailer")

REPLAY_PAGE = 1000
TAILER_BLOCK_MS = 10_000  # how long one XREAD of the tailer's blocks
# The wake-up stream outlives a process that died without deleting it by this long; a live process
# renews that once every `_WAKE_RENEW_SECONDS`, not at every poke.
_WAKE_TTL_SECONDS = 3600
_WAKE_RENEW_SECONDS = 600.0


# A stream entry as Redis sends it: its id and its fields, `[name, value, ...]`.
type FlatEntry = tuple[bytes, list[bytes]]


class _Idle:
    """What a subscriber's idle timer puts in its queue: nothing came for `idle_seconds`."""


_IDLE: Final = _Idle()


class Passthrough:
    """Where a follower's live events may be written as the tailer's read brings them (`write`:
    whether it wrote the event), set by the relay once it can write them so: then no task wakes up,
    and no queue takes or gives, for an event (a token), where each woke its relay's task, which
    took it from its queue through the follower's generator to its write.

    Only while the follower's task waits with nothing in its queue (else that would be written
    after what comes later), never its terminal event (the follower ends at it, its relay with
    it): those go by the queue, as does every event once `write` says no (a client slow to read,
    gone), until the follower waits again."""

    __slots__ = ("write",)

    def __init__(self) -> None:
        self.write: Callable[[Event], bool] | None = None


@dataclass(eq=False)
class _Subscriber:
    position: int
    queue: asyncio.Queue[Event | RedisError | _Idle] = field(default_factory=asyncio.Queue)
    taken_at: float = 0.0  # the loop time its reader last took something from `queue`
    passthrough: Passthrough | None = None
    waiting: bool = False  # its reader waits on an empty `queue`: its events may pass through
    # A `position` its stream has not shown (a cursor past its end, or none): no sign of a stream
    # lost while the subscriber is still there (`is_behind`).
    unseen: int = -1

    def is_behind(self, newest: int) -> bool:
        """Whether this subscriber has an event newer than the stream's newest (`newest`)."""
        return self.position != self.unseen and self.position > newest


async def _take_until(
    subscriber: _Subscriber, idle_seconds: float | None, until: float
) -> Event | RedisError | _Idle | None:
    """A finished response's next item, no later than `until` (None: it passed); `_IDLE` after
    `idle_seconds` without one."""
    loop = asyncio.get_running_loop()
    timeout = min(idle_seconds or math.inf, max(0.0, until - loop.time()))
    try:
        return await asyncio.wait_for(subscriber.queue.get(), timeout)
    except TimeoutError:
        return None if loop.time() >= until else _IDLE


class _IdleTimer:
    """One timer per subscriber, re-armed when it fires, that puts `_IDLE` once nothing was taken
    for `seconds`: a timer for each event (`wait_for`) cost a tenth of an API's CPU per token."""

    def __init__(self, subscriber: _Subscriber, seconds: float) -> None:
        self._subscriber = subscriber
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(seconds, self._fire)

    def _fire(self) -> None:
        subscriber = self._subscriber
        quiet = self._loop.time() - subscriber.taken_at
        if quiet >= self._seconds:
            if subscriber.queue.empty():  # else its reader has yet to take what is there
                subscriber.queue.put_nowait(_IDLE)
            quiet = 0.0
        self._handle = self._loop.call_later(self._seconds - quiet, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()


class Tailer:
    """Relays live events of many responses to many readers over one blocking connection."""

    def __init__(
        self,
        redis: Redis,
        blocking: Redis,
        block_ms: int = 10_000,
        finishing_seconds: float = 10.0,
        batch_seconds: float = 0.0,
        outage_seconds: float = 60.0,
        timeout_seconds: float = 5.0,
    ) -> None:
        self._redis = redis  # the process's pool: replays and wake-ups
        self._blocking = blocking  # a connection of its own, held by XREAD BLOCK
        self._reads = HeldConnection(blocking)  # `_run`'s, one read at a time
        self._pokes = HeldConnections(redis, 1)  # at most one poke waits for its read's end
        self._block_ms = block_ms
        # How long a finished response's terminal event may still be on its way (it follows the commit).
        self._finishing_seconds = finishing_seconds
        # Under load, reads go no more often than this (DESIGN.md §7): see `_run`.
        self._batch_seconds = batch_seconds
        # How long subscribers wait for an unreachable Redis (RESPOOL_REDIS_OUTAGE_SECONDS), and
        # how long one try to reach it again may take (RESPOOL_REDIS_TIMEOUT_SECONDS).
        self._outage_seconds = outage_seconds
        self._timeout_seconds = timeout_seconds
        self._wake = wake_key(uuid.uuid4().hex)
        self._wake_position = "0-0"
        self._wake_pending = False  # a poke went since the keys of the next read were taken
        self._wake_renew_at = -math.inf
        self._subscribers: dict[str, set[_Subscriber]] = {}
        self._task: asyncio.Task[None] | None = None
        self._is_reaching = False  # a read failed, and Redis has not answered since

    async def start(self) -> None:
        """Start relaying. With Redis unreachable the process starts all the same (its routes answer
        503 meanwhile), and the tail begins once Redis is back."""
        try:
            self._wake_position = (await self._poke()).decode()
        except RedisError as exc:
            log.warning(
                "tailer: Redis is unreachable at start (%r); serving, and tailing once it is back", exc
            )
            self._wake_position = "0-0"  # the wake-up stream, from its beginning once it exists
        self._task = asyncio.create_task(self._run(), name="tailer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError):  # it expires on its own if Redis is down now
            await self._redis.delete(self._wake)
        await self._pokes.close()
        await self._blocking.aclose(close_connection_pool=True)  # a pool of its own (`blocking_client`)

    async def follow(
        self,
        response_id: str,
        after: int = -1,
        idle_seconds: float | None = None,
        is_finished: bool = False,
        *,
        is_new: bool = False,
        passthrough: Passthrough | None = None,
    ) -> AsyncGenerator[Event | None]:
        """Every event with `sequence_number > after`, stored then live, up to the terminal event.

        Yields None after `idle_seconds` without an event (the SSE relay's heartbeat cue). Of a
        response known to be finished, the stored events, and only if its stream lacks the terminal
        event (Postgres commits first, DESIGN.md §2.3), what comes live within `finishing_seconds`:
        an `after` past the end is an empty stream, and a stream that expired never hangs.

        The first read marks the response observed, in the same step: from then on no new attempt
        starts its output over (DESIGN.md §4, "Orphans"), which would take back what was relayed.
        A response its create followed at once (`is_new`) was marked at its enqueue: it is followed
        from its first event by the live tail alone, with no read before (a round trip less a
        foreground create). With a `passthrough`, live events may be written by it
        instead of yielded (`Passthrough`).
        """
        position = after
        page = (
            []
            if is_new
            else await read_events_observed(self._redis, response_id, position, count=REPLAY_PAGE)
        )
        while page:  # the replay, page by page
            for event in page:
                yield event
                if event.is_terminal:
                    return
            if len(page) < REPLAY_PAGE:
                break
            position = page[-1].sequence_number
            page = await read_events(self._redis, response_id, position, count=REPLAY_PAGE)
        if page:
            position = page[-1].sequence_number
        until = None
        if is_finished:
            last = await last_event(self._redis, response_id)
            if last is None:
                return
            if last.is_terminal:  # appended since the replay read (its writer ended it meanwhile)
                for event in await read_events(self._redis, response_id, position):
                    yield event
                return
            until = asyncio.get_running_loop().time() + self._finishing_seconds
        # Live, in this generator itself: a generator of its own was a layer a token.
        subscriber = await self._subscribe(response_id, position)
        if position == after:  # nothing replayed: its cursor is the client's own (or none)
            subscriber.unseen = position
        if until is None:
            subscriber.passthrough = passthrough
        timer = _IdleTimer(subscriber, idle_seconds) if idle_seconds and until is None else None
        item: Event | RedisError | _Idle | None
        try:
            while True:
                if until is None:
                    subscriber.waiting = True  # its events may pass through while it waits
                    try:
                        item = await subscriber.queue.get()
                    finally:
                        subscriber.waiting = False
                else:
                    item = await _take_until(subscriber, idle_seconds, until)
                    if item is None:
                        return
                subscriber.taken_at = asyncio.get_running_loop().time()
                if isinstance(item, _Idle):
                    yield None
                    if until is None and await self._is_lost(response_id, subscriber):
                        raise TailLostError(LOST, is_resumable=False)
                    continue
                if isinstance(item, RedisError):
                    if isinstance(item, TailLostError):
                        raise TailLostError(str(item), is_resumable=item.is_resumable) from item
                    raise RedisConnectionError(f"the live tail lost Redis: {item}") from item
                yield item
                if item.is_terminal:
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self._unsubscribe(response_id, subscriber)

    async def terminal(self, response_id: str, *, is_new: bool = False) -> Event | None:
        """The response's terminal event, once it comes (None if its stream ends without one), as
        `follow` brings it. Its follow is closed here, at that event: a generator left to the collector
        is closed by a task of its own, that the loop's finalizer hook wakes the loop to start (an
        eventfd's write and read, a wake-up and a task each foreground request: paired, 0.905 of its
        CPU at a background response's rate)."""
        async with contextlib.aclosing(self.follow(response_id, is_new=is_new)) as events:
            async for event in events:
                if event is not None and event.is_terminal:
                    return event
        return None

    async def _subscribe(self, response_id: str, position: int) -> _Subscriber:
        """A subscriber to the response's events after `position`, in the tailer's next read."""
        subscriber = _Subscriber(position, taken_at=asyncio.get_running_loop().time())
        self._subscribers.setdefault(events_key(response_id), set()).add(subscriber)
        if not self._wake_pending:  # else the read that poke ends is followed by one with this key
            self._wake_pending = True
            try:
                await self._poke()
            except BaseException:
                self._unsubscribe(response_id, subscriber)
                self._wake_pending = False
                raise
        return subscriber

    def _unsubscribe(self, response_id: str, subscriber: _Subscriber) -> None:
        key = events_key(response_id)
        subscribers = self._subscribers.get(key)
        if subscribers is not None:
            subscribers.discard(subscriber)
            if not subscribers:
                del self._subscribers[key]

    async def _poke(self) -> bytes:
        """End the blocked read: one XADD to the wake-up stream, sent bare on a held connection (a
        pipeline with the key's expiry at every poke was a fifteenth of an API's CPU a short
        response); the id it added. The expiry is renewed when due (and after Redis was away: it may be a new key)."""
        entry = await self._pokes.command("XADD", self._wake, "MAXLEN", 10, "*", "w", 1)
        now = asyncio.get_running_loop().time()
        if now >= self._wake_renew_at:
            await self._pokes.command("EXPIRE", self._wake, _WAKE_TTL_SECONDS)
            self._wake_renew_at = now + _WAKE_RENEW_SECONDS
        return bytes(entry)

    async def _run(self) -> None:
        """Read, and read again: at once after a read that brought events of at most one stream (a
        lone stream waits for nothing, however many events a read brings it: its first ones come
        together), else `batch_seconds` after the last read began, so that the next one brings what
        many streams appended meanwhile (30 streams of tokens 20 ms apart brought 1.5 events a read
        without this)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                started = loop.time()
                if await self._read_once() > 1:
                    wait = started + self._batch_seconds - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
            except RedisError as exc:
                await self._after_failed_read(exc)
                self._wake_renew_at = -math.inf  # a Redis that restarted may hold a new wake-up key

    async def _read_once(self) -> int:
        """One XREAD over every followed stream; how many of them it brought events."""
        keys = [self._wake]
        positions = [self._wake_position]
        self._wake_pending = False  # a subscriber added from here on is not in this read: it pokes
        for key, subscribers in self._subscribers.items():
            keys.append(key)
            positions.append(entry_id(min(subscriber.position for subscriber in subscribers)))
        # As Redis sent it, on the held connection: redis-py's parsing of XREAD's reply (a dict per
        # entry) was a seventh of an API's CPU per token, its per-command machinery half the read's.
        reply = await self._reads.command("XREAD", "BLOCK", self._block_ms, "STREAMS", *keys, *positions)
        if not reply:
            return 0
        # RESP3 sends a map of stream to entries, RESP2 a list of (stream, entries) pairs.
        streams: list[tuple[bytes, list[FlatEntry]]] = list(
            reply.items() if isinstance(reply, dict) else reply
        )
        brought = 0
        for stream, entries in streams:
            name = stream.decode()
            if name == self._wake:
                self._wake_position = entries[-1][0].decode()
                continue
            brought += 1
            self._deliver(name, entries)
        return brought

    async def _after_failed_read(self, exc: RedisError) -> None:
        """Wait for Redis to answer again, every subscriber kept, for up to `outage_seconds`; then
        end those whose streams it no longer has. Past the bound, end every subscriber. An error
        that is not an outage ends them all at once."""
        if not is_redis_outage(exc):
            log.warning("tailer: reading streams failed (%r): ending %d live readers", exc, self._count())
            self._end_all(exc)
            await asyncio.sleep(1)
            return
        loop = asyncio.get_running_loop()
        began = loop.time()
        log.warning(
            "tailer: Redis is unreachable (%r): %d live readers wait for it, up to %g s",
            exc,
            self._count(),
            self._outage_seconds,
        )
        self._is_reaching = True
        try:
            lost = await tail_outage.reach_again(
                self._reads, self._subscribers, began, self._outage_seconds, self._timeout_seconds
            )
        except RedisError as failed:
            log.warning("tailer: Redis answers with an error (%r): ending every live reader", failed)
            self._end_all(failed)
            return
        finally:
            self._is_reaching = False
        away = loop.time() - began
        if lost is None:
            log.error("tailer: Redis unreachable for %.0f s: ending %d live readers", away, self._count())
            message = tail_outage.unreachable(away, self._outage_seconds)
            self._end_all(TailLostError(message, is_resumable=True))
            return
        for key in lost:
            self._end_key(key, TailLostError(LOST, is_resumable=False))
        log.warning(
            "tailer: Redis answers again after %.1f s: %d live readers continue; it lost %d of their streams",
            away,
            self._count(),
            len(lost),
        )

    async def _is_lost(self, response_id: str, subscriber: _Subscriber) -> bool:
        """Whether a quiet stream is lost (`tail_outage.is_lost`), asked at its follower's idle
        cue: a Redis that restarted empty between two reads, unseen by the tail (its connection
        came back at once), would leave the follower waiting for ever. Not while the tail waits for
        Redis, nor if Redis does not answer: the tail's own failed read deals with an outage."""
        if self._is_reaching:
            return False
        try:
            newest = await last_event(self._redis, response_id)
        except RedisError:
            return False
        return tail_outage.is_lost(newest, subscriber)

    def _count(self) -> int:
        return sum(len(subscribers) for subscribers in self._subscribers.values())

    def _end_key(self, key: str, exc: RedisError) -> None:
        """End the subscribers of one stream with `exc`."""
        for subscriber in self._subscribers.pop(key, ()):
            subscriber.queue.put_nowait(exc)

    def _end_all(self, exc: RedisError) -> None:
        """End every live subscriber with `exc`, after the events already delivered to it."""
        for subscribers in self._subscribers.values():
            for subscriber in subscribers:
                subscriber.queue.put_nowait(exc)
        self._subscribers.clear()

    def _deliver(self, key: str, entries: list[FlatEntry]) -> None:
        subscribers = self._subscribers.get(key)
        if not subscribers:
            return
        events = [decode_flat(entry, fields) for entry, fields in entries]  # once, for every reader
        for subscriber in subscribers:
            through = subscriber.passthrough
            write = through.write if through is not None and subscriber.waiting else None
            written = False
            for event in events:
                if event.sequence_number > subscriber.position:
                    subscriber.position = event.sequence_number
                    if write is not None and not event.is_terminal and write(event):
                        written = True
                        continue
                    write = None  # the rest go after it, by the queue too
                    subscriber.waiting = False  # until its reader has taken what is there
                    subscriber.queue.put_nowait(event)
            if written:
                subscriber.taken_at = asyncio.get_running_loop().time()  # no silence to hear of
