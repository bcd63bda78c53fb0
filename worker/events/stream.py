"""The event log: one Redis stream per response, appended in order, replayable from any offset.

Entry ids are explicit, `0-<sequence_number + 1>` (Redis rejects `0-0`), so Redis itself refuses an
append that is not after the last one: a retried or stale write can never duplicate or interleave
(DESIGN.md §3). Each entry holds the event type (`t`) and the event JSON (`d`), encoded once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from functools import partial
from typing import Any, NamedTuple, cast

import orjson
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from worker.connections import HeldConnection
from worker.errors import FencedOutError
from worker.events.lease import Lease, Leases
from worker.keys import attempt_key, cancel_key, events_key, lease_key, observed_key
from worker.outages import is_redis_outage
from worker.protocol.response import TERMINAL_EVENTS

log = logging.getLogger("respool.events")

# One round trip's appends, of any number of responses (DESIGN.md §7). For each response in turn:
# KEYS its lease, events and cancel keys, and for one whose append is its final one (its keys'
# retention starts, and perhaps it leaves its queue) its attempt and observed keys too, then, if it
# leaves its queue in the same step, the queue's held set and its queued key. ARGV its lease value,
# then how many events: a number for a plain append, `<count>:<seconds>:<id or nothing>` for a
# final one (how many seconds its keys are kept from now: a final append starts their retention
# clock, DESIGN.md §2.7, in the same step; its id if it leaves its queue), then an (entry id, type,
# data) triple per event. Answers, for each response: -1 when fenced out (the lease is not its
# writer's), else whether a cancel was requested; or the error its first refused XADD met (an
# "equal or smaller" id: DESIGN.md §3), after which none of its later events are added (nor its
# keys' expiry set, nor its queue left: the try that added them did).
# One script call for all of them, one command to pack where a pipeline packed one per response: a
# worker's CPU a token fell 9% at 30 streams, 14% at 100 (README, CPU cost). A response leaving its
# queue here (`ResponseQueue.finished`'s work: out of the held set, its queued key and its lease
# gone) saves its worker a round trip at its end. A plain append (a token's, all but one of a
# response's) names three keys and two arguments besides its events, not five and four: Redis's
# CPU for it fell an eighth, measured alone (13.8 -> 12.0 µs a token).
_FENCED_APPEND = """
local results = {}
local at = 1
local k = 1
while k <= #KEYS do
  local lease, spec, first = ARGV[at], ARGV[at + 1], at + 2
  local count, retain, leaving, width = tonumber(spec), 0, '', 3
  if not count then
    local n, seconds, id = string.match(spec, '^(%d+):(%d+):(.*)$')
    count, retain, leaving, width = tonumber(n), tonumber(seconds), id, (id ~= '' and 7 or 5)
  end
  at = first + 3 * count
  local result
  if redis.call('GET', KEYS[k]) ~= lease then
    result = -1
  else
    for i = first, at - 1, 3 do
      local added = redis.pcall('XADD', KEYS[k + 1], ARGV[i], 't', ARGV[i + 1], 'd', ARGV[i + 2])
      if type(added) == 'table' and added.err then result = added break end
    end
    if not result then
      result = redis.call('EXISTS', KEYS[k + 2])
      if retain > 0 then
        for j = k + 1, k + 4 do redis.call('EXPIRE', KEYS[j], retain) end
      end
      if leaving ~= '' then
        redis.call('ZREM', KEYS[k + 5], leaving)
        redis.call('DEL', KEYS[k + 6], KEYS[k])
      end
    end
  end
  results[#results + 1] = result
  k = k + width
end
return results
"""

# KEYS: events, observed. ARGV: the first entry id to read, how many. A relay's first read: marks the
# response observed (DESIGN.md §4, "Orphans") in the same step, so no attempt can start its output
# over between the read and the mark. A stream that is gone (expired, deleted) leaves no mark.
_OBSERVED_READ = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('SET', KEYS[2], '1')
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
end
return redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
"""

# KEYS: lease, events, observed. ARGV: lease value. A new attempt's start over of an unobserved
# response: the stream keeps only its leading lifecycle events (created, queued, in_progress) and
# loses the dead attempt's output. Returns -1 when fenced out, -2 when a relay has read the stream
# (nothing changes), else {how many events were kept, the type of the last one kept}.
_START_OVER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('EXISTS', KEYS[3]) == 1 then return -2 end
local head = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 3)
local kept = {}
for _, entry in ipairs(head) do
  local kind = entry[2][2]  -- every XADD writes `t` (the type) first, then `d`
  if kind ~= 'response.created' and kind ~= 'response.queued' and kind ~= 'response.in_progress' then break end
  kept[#kept + 1] = entry
end
redis.call('DEL', KEYS[2])
for _, entry in ipairs(kept) do redis.call('XADD', KEYS[2], entry[1], unpack(entry[2])) end
local last = kept[#kept]
return {#kept, last and last[2][2] or ''}
"""

# A stream entry as redis-py returns it: (entry id, fields).
Entry = tuple[bytes, dict[bytes, bytes]]


class Event(NamedTuple):
    """One stored event: its sequence number, type and JSON bytes. A named tuple, immutable as a
    frozen dataclass is, and made in under half its time (0.8 µs against 1.8, on this project's
    machine): one is made a token in the worker (`encode`) and one in each API relaying it
    (`decode_flat`)."""

    sequence_number: int
    type: str
    data: bytes

    @property
    def is_terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    def payload(self) -> dict[str, Any]:
        decoded: dict[str, Any] = orjson.loads(self.data)
        return decoded


class AppendResult(IntEnum):
    FENCED = -1
    OK = 0
    CANCEL_REQUESTED = 1


def entry_id(sequence_number: int) -> str:
    return f"0-{sequence_number + 1}"


def sequence_of(entry: bytes | str) -> int:
    """The sequence number of a stream entry id `0-<seq+1>`."""
    text = entry.decode() if isinstance(entry, bytes) else entry
    return int(text.partition("-")[2]) - 1


def encode(event: dict[str, Any], sequence_number: int) -> Event:
    """Number an event and encode it, once (DESIGN.md §7)."""
    event["sequence_number"] = sequence_number
    return Event(sequence_number, event["type"], orjson.dumps(event))


def decode_entry(entry_id_: bytes, fields: dict[bytes, bytes]) -> Event:
    return Event(sequence_of(entry_id_), fields[b"t"].decode(), fields[b"d"])


def decode_flat(entry_id_: bytes, flat: list[bytes]) -> Event:
    """An entry whose fields came as Redis sends them, `[name, value, ...]` (every XADD of ours
    writes `t` then `d`, so that order is read without building a dict)."""
    if len(flat) == 4 and flat[0] == b"t" and flat[2] == b"d":
        return Event(sequence_of(entry_id_), flat[1].decode(), flat[3])
    return decode_entry(entry_id_, _fields(flat))


async def read_events(
    redis: Redis, response_id: str, after: int = -1, count: int | None = None
) -> list[Event]:
    """The stored events with `sequence_number > after` (`starting_after`, PROTOCOL.md §6.3)."""
    start = f"({entry_id(after)}" if after >= 0 else "-"
    entries = cast(list[Entry], await redis.xrange(events_key(response_id), min=start, max="+", count=count))
    return [decode_entry(entry_id_, fields) for entry_id_, fields in entries]


async def read_events_observed(
    redis: Redis, response_id: str, after: int = -1, count: int = 1000
) -> list[Event]:
    """`read_events`, marking the response observed in the same step (a relay's first read)."""
    start = f"({entry_id(after)}" if after >= 0 else "-"
    keys = [events_key(response_id), observed_key(response_id)]
    entries = await redis.eval(_OBSERVED_READ, 2, *keys, start, count)
    return [decode_flat(entry[0], entry[1]) for entry in entries]


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields as Lua returns them, `[name, value, ...]`, as redis-py's dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


@dataclass(frozen=True)
class StartedOver:
    """What a start over kept: the first `kept` events, the last of them of type `last_type`."""

    kept: int
    last_type: str | None


async def start_over(redis: Redis, lease: Lease) -> StartedOver | None:
    """Drop the output of the response's earlier attempts from its stream, unless a relay has read it
    (None then). Raises `FencedOutError` unless `lease` still holds."""
    rid = lease.response_id
    keys = [lease_key(rid), events_key(rid), observed_key(rid)]
    result = await redis.eval(_START_OVER, 3, *keys, lease.value)
    if result == -1:
        raise FencedOutError(rid)
    if result == -2:
        return None
    kept, last_type = result
    return StartedOver(int(kept), last_type.decode() if last_type else None)


async def last_event(redis: Redis, response_id: str) -> Event | None:
    """The newest event of a response's stream, if any."""
    entries = cast(list[Entry], await redis.xrevrange(events_key(response_id), max="+", min="-", count=1))
    return decode_entry(*entries[0]) if entries else None


async def take_lease(leases: Leases, response_id: str, holder: str) -> tuple[Lease, Event | None] | None:
    """A new lease on the response and its stream's newest event (None: an empty stream), read in
    the same step; None while another holder's lease is alive."""
    acquired = await leases.acquire_reading(response_id, holder)
    if acquired is None:
        return None
    lease, newest = acquired
    return lease, None if newest is None else decode_flat(*newest)


async def expire_response(redis: Redis, response_id: str, seconds: int) -> None:
    """Start the retention clock of a finished response's keys (DESIGN.md §2.7)."""
    keys = (
        events_key(response_id),
        attempt_key(response_id),
        cancel_key(response_id),
        observed_key(response_id),
    )
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.expire(key, seconds)
        await pipe.execute()


# What an append's round trip ends with: its result, or what it met (an error reply, an outage).
type Outcome = AppendResult | Exception
# The keys a response leaves its queue by (`ResponseQueue.leaving`): the queue's held set, its queued key.
type Leaving = tuple[str, str]
# An append waiting for its round trip: its lease, events, retention (0: none), the queue it leaves
# (None: none) and whom to tell.
type _Append = tuple[Lease, list[Event], int, Leaving | None, Callable[[Outcome], object]]


# The script's answers for an append, as the outcomes they say (a lookup, not the enum's call: a
# microsecond an append).
_OUTCOMES: dict[int, AppendResult] = {int(result): result for result in AppendResult}


def _settle(future: asyncio.Future[AppendResult], outcome: Outcome) -> None:
    if future.done():  # its awaiting task was cancelled
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class EventLog:
    """Fenced appends for every response a process holds, batched into one script call per round trip.

    While one call is in flight, appends queue up, and the next round trip takes all of them
    (DESIGN.md §7, "natural batching"). Under load a round trip carries more than one append; the
    next one then goes no sooner than `batch_seconds` after it started, so many streams' appends
    share it (at 30 streams of tokens 20 ms apart, a round trip carried one token without this). A
    round trip that carried one append is followed at once: a lone stream never waits.
    """

    def __init__(
        self,
        redis: Redis,
        on_append: Callable[[int], object] | None = None,
        batch_seconds: float = 0.0,
        on_outage: Callable[[], object] | None = None,
    ) -> None:
        self.redis = redis
        self._on_append = on_append  # told how many events each successful append added
        self._on_outage = on_outage  # told of each round trip Redis was unreachable for
        self._batch_seconds = batch_seconds
        self._next_at = 0.0  # the loop time before which no pipeline goes (under load)
        self._sha = hashlib.sha1(_FENCED_APPEND.encode()).hexdigest()
        self._connection = HeldConnection(redis)  # round trips go one at a time (`_flush`)
        self._pending: list[_Append] = []
        self._flushing = False

    async def append(
        self, lease: Lease, events: list[Event], retain_seconds: int = 0, leaving: Leaving | None = None
    ) -> AppendResult:
        """Append `events` (in order) if `lease` still holds; report a fence or a cancel request.
        With `retain_seconds`, the response's keys are kept that long from the append on (its
        final one: `expire_response` in the same step); with `leaving`, the response leaves its
        queue and its lease is given back in the same step too (`ResponseQueue.finished`)."""
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        self.submit(lease, events, retain_seconds, partial(_settle, future), leaving)
        return await future

    async def flushed(self, lease: Lease) -> None:
        """Return once every append submitted before this call has been told its outcome: round trips
        go one at a time, in order, so an empty append under `lease` after them is a barrier. Whoever
        reads where a stream ends for a writer it cannot settle (an attempt that broke) reads after it."""
        await self.append(lease, [])

    def submit(
        self,
        lease: Lease,
        events: list[Event],
        retain_seconds: int,
        done: Callable[[Outcome], object],
        leaving: Leaving | None = None,
    ) -> None:
        """`append`, without waiting: `done` is called with its outcome, from the round trip's task
        (a writer appending a token a time needs no task or future of its own for each)."""
        self._pending.append((lease, events, retain_seconds, leaving, done))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                wait = self._next_at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                batch, self._pending = self._pending, []
                self._next_at = loop.time() + self._batch_seconds if len(batch) > 1 else 0.0
                await self._send(batch)
        finally:
            self._flushing = False

    async def _send(self, batch: list[_Append]) -> None:
        try:
            try:
                results = await self._execute(batch)
            except NoScriptError:  # a Redis that restarted (or flushed its scripts) ran none of them
                results = await self._execute(batch, whole=True)
        except Exception as exc:  # the connection failed: every append in the batch did
            results = [exc] * len(batch)
            if self._on_outage is not None and is_redis_outage(exc):
                self._on_outage()
        added = 0
        for (_, events, _, _, done), result in zip(batch, results, strict=True):
            outcome = _OUTCOMES[result] if type(result) is int else result
            if outcome is AppendResult.OK or outcome is AppendResult.CANCEL_REQUESTED:
                added += len(events)
            try:
                done(outcome)
            except Exception:  # one writer's fault must not cost the rest of the batch their outcomes
                log.exception("telling an append's outcome failed")
        # Counted here, where the outcomes are known, even if whoever awaited one was cancelled
        # meanwhile; once a round trip, not once an append (a lock's round a token).
        if added and self._on_append is not None:
            self._on_append(added)

    async def _execute(self, batch: list[_Append], whole: bool = False) -> list[Any]:
        """One EVALSHA for the whole batch (redis-py's script objects would add a SCRIPT EXISTS
        round trip each time), on the log's own connection (`HeldConnection`); an append that
        failed is its exception in the list."""
        keys: list[str | bytes] = []
        args: list[str | bytes | int] = []
        for lease, events, retain_seconds, leaving, _ in batch:
            appended = lease.appended
            if retain_seconds or leaving is not None:  # a final append: its keys' clock, its queue
                keys += appended[:5]
                if leaving is not None:
                    keys += leaving
                leaves = lease.response_id if leaving is not None else ""
                args += (appended[5], f"{len(events)}:{retain_seconds}:{leaves}")
            else:
                keys += appended[:3]
                args += (appended[5], len(events))
            for event in events:
                args += (b"0-%d" % (event.sequence_number + 1), event.type, event.data)  # entry_id's
        # `whole`: the script sent itself (EVAL), after a NOSCRIPT; not loaded then asked for again,
        # which scripts flushed in between would fail.
        script = ("EVAL", _FENCED_APPEND) if whole else ("EVALSHA", self._sha)
        results: list[Any] = await self._connection.command(*script, len(keys), *keys, *args)
        return results
