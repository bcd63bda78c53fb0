"""The event log on a real Redis: fenced appends, and appends after Redis lost its scripts."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from redis.asyncio import ConnectionPool, Redis
from redis.exceptions import ResponseError

from worker.connections import hiredis_packing
from worker.errors import FencedOutError
from worker.events.lease import Lease, Leases
from worker.events.stream import (
    AppendResult,
    EventLog,
    StartedOver,
    decode_flat,
    encode,
    expire_response,
    read_events,
    read_events_observed,
    start_over,
)
from worker.keys import attempt_key, cancel_key, events_key, lease_key, observed_key

pytestmark = pytest.mark.integration


def _events(first: int, count: int) -> list[dict[str, object]]:
    return [{"type": "response.output_text.delta", "delta": f"d{first + index}"} for index in range(count)]


async def test_appends_land_in_order_and_a_stale_lease_is_fenced(redis: Redis) -> None:
    response_id = f"resp_{uuid.uuid4().hex}"
    leases = Leases(redis, 5)
    log = EventLog(redis)
    first = await leases.acquire(response_id, "a")
    assert first is not None
    events = [encode(event, index) for index, event in enumerate(_events(0, 3))]
    assert await log.append(first, events) is AppendResult.OK
    await leases.release(first)
    second = await leases.acquire(response_id, "b")
    assert second is not None
    assert await log.append(first, [encode(_events(3, 1)[0], 3)]) is AppendResult.FENCED
    assert [event.sequence_number for event in await read_events(redis, response_id)] == [0, 1, 2]


# It flushes the scripts of the Redis it runs on: never one that other sessions share (CI's second phase).
@pytest.mark.once
async def test_an_append_after_redis_forgot_its_scripts_lands_once(redis: Redis) -> None:
    """Appends send EVALSHA alone (no SCRIPT EXISTS each time); a NOSCRIPT reply (Redis restarted,
    or SCRIPT FLUSH) sends just those appends again with the script whole (EVAL)."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await Leases(redis, 5).acquire(response_id, "a")
    assert lease is not None
    log = EventLog(redis)
    assert await log.append(lease, [encode(_events(0, 1)[0], 0)]) is AppendResult.OK
    await redis.script_flush()
    assert (
        await log.append(lease, [encode(event, 1 + i) for i, event in enumerate(_events(1, 2))])
        is AppendResult.OK
    )
    stored = await read_events(redis, response_id)
    assert [event.payload()["delta"] for event in stored] == ["d0", "d1", "d2"]


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/0", "Connection"),
        ("unix:///tmp/redis.sock", "UnixDomainSocketConnection"),
        ("rediss://127.0.0.1:6379/0", "SSLConnection"),
    ],
)
def test_hiredis_packing_keeps_the_connection_kind_and_packs_as_redis_py_does(url: str, base: str) -> None:
    """hiredis packs every argument kind exactly as redis-py's own Python packer would."""
    pool = hiredis_packing(ConnectionPool.from_url(url))
    assert pool.connection_class.__mro__[2].__name__ == base
    assert hiredis_packing(pool).connection_class is pool.connection_class  # once only
    ours = pool.make_connection()
    theirs = pool.connection_class.__mro__[2](**pool.connection_kwargs)
    for args in (
        ("XADD", "key", "0-1", "t", "response.created", "d", b'{"a":"\xc3\xa9"}'),
        ("CONFIG GET", "maxmemory"),
        ("EVALSHA", "f" * 40, 3, "a", "b", "c", 1.5, "é"),
    ):
        assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


async def _stream_of(redis: Redis, response_id: str, kinds: list[str], lease_holder: str = "a") -> Lease:
    """A response's stream holding one event of each of `kinds`, appended under a lease it returns."""
    lease = await Leases(redis, 5).acquire(response_id, lease_holder)
    assert lease is not None
    events = [encode({"type": kind}, number) for number, kind in enumerate(kinds)]
    assert await EventLog(redis).append(lease, events) is AppendResult.OK
    return lease


LIFECYCLE = ["response.created", "response.queued", "response.in_progress"]
OUTPUT = ["response.output_item.added", "response.output_text.delta", "response.output_text.delta"]


async def test_a_start_over_keeps_the_lifecycle_events_and_drops_the_output(redis: Redis) -> None:
    """Unobserved, a start over leaves created/queued/in_progress, and the next appends number on from them."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await _stream_of(redis, response_id, LIFECYCLE + OUTPUT)
    started = await start_over(redis, lease)
    assert started == StartedOver(3, "response.in_progress")
    assert [event.type for event in await read_events(redis, response_id)] == LIFECYCLE
    again = [encode({"type": "response.output_item.added"}, 3)]
    assert await EventLog(redis).append(lease, again) is AppendResult.OK
    assert [event.sequence_number for event in await read_events(redis, response_id)] == [0, 1, 2, 3]


async def test_a_foreground_start_over_keeps_what_it_had(redis: Redis) -> None:
    """A foreground stream (no `queued`) keeps created and in_progress; one that had only created keeps that."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await _stream_of(redis, response_id, ["response.created", "response.in_progress", *OUTPUT])
    assert await start_over(redis, lease) == StartedOver(2, "response.in_progress")


async def test_a_relay_read_marks_the_response_observed_and_a_start_over_then_changes_nothing(
    redis: Redis,
) -> None:
    """Once a relay has read the stream, a start over refuses and the stream stays as told."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await _stream_of(redis, response_id, LIFECYCLE + OUTPUT)
    read = await read_events_observed(redis, response_id, 1, count=2)
    assert [event.sequence_number for event in read] == [2, 3]
    assert read[0].payload() == {"type": "response.in_progress", "sequence_number": 2}
    assert await start_over(redis, lease) is None
    assert len(await read_events(redis, response_id)) == 6


async def test_a_start_over_under_a_lost_lease_is_fenced(redis: Redis) -> None:
    """Only the holder of the response's lease may start its stream over."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await _stream_of(redis, response_id, LIFECYCLE + OUTPUT)
    await redis.delete(lease_key(response_id))
    with pytest.raises(FencedOutError):
        await start_over(redis, lease)
    assert len(await read_events(redis, response_id)) == 6


async def test_reading_an_expired_stream_leaves_no_mark(redis: Redis) -> None:
    """A read of a stream that is gone sets nothing (no key without an expiry is left behind)."""
    response_id = f"resp_{uuid.uuid4().hex}"
    assert await read_events_observed(redis, response_id) == []
    assert not await redis.exists(observed_key(response_id))


async def test_the_mark_expires_with_a_finished_stream(redis: Redis) -> None:
    """The observed mark takes the stream's expiry, set with it when the response ends or later."""
    response_id = f"resp_{uuid.uuid4().hex}"
    await _stream_of(redis, response_id, LIFECYCLE)
    await expire_response(redis, response_id, 100)
    await read_events_observed(redis, response_id)
    assert 0 < await redis.ttl(observed_key(response_id)) <= 100


async def test_a_lone_stream_never_waits_for_the_batch_interval(redis: Redis) -> None:
    """Appends of one response, one at a time, go at once: with an interval of an hour they all land."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await Leases(redis, 5).acquire(response_id, "a")
    assert lease is not None
    log = EventLog(redis, batch_seconds=3600)
    for index, event in enumerate(_events(0, 20)):
        result = await asyncio.wait_for(log.append(lease, [encode(event, index)]), 10)
        assert result is AppendResult.OK
    assert len(await read_events(redis, response_id)) == 20


def _round_trips(log: EventLog, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many appends each of `log`'s round trips carries from now on, filled in as they go."""
    round_trips: list[int] = []
    execute = log._execute

    async def counted(batch: list[Any]) -> list[Any]:
        round_trips.append(len(batch))
        return await execute(batch)

    monkeypatch.setattr(log, "_execute", counted)
    return round_trips


async def test_under_load_many_streams_share_one_round_trip(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a round trip that carried more than one append, the next waits out the interval and
    takes every append that came meanwhile, each stream's in order."""
    leases = Leases(redis, 30)
    log = EventLog(redis, batch_seconds=2.0)
    round_trips = _round_trips(log, monkeypatch)
    ids = [f"resp_{uuid.uuid4().hex}" for _ in range(10)]
    held = [await leases.acquire(response_id, "a") for response_id in ids]
    assert all(lease is not None for lease in held)

    async def append(lease: Lease | None, sequence_number: int) -> AppendResult:
        assert lease is not None
        return await log.append(lease, [encode(_events(sequence_number, 1)[0], sequence_number)])

    # Two at once: one round trip of two.
    assert await asyncio.gather(append(held[0], 0), append(held[1], 0)) == [AppendResult.OK] * 2
    # Then ten streams' appends arriving 5 ms apart, within the interval: one round trip.
    tasks = []
    for lease in held:
        tasks.append(asyncio.create_task(append(lease, 1 if lease in held[:2] else 0)))
        await asyncio.sleep(0.005)
    assert await asyncio.gather(*tasks) == [AppendResult.OK] * 10
    assert round_trips == [2, 10]
    for response_id, count in zip(ids, [2, 2] + [1] * 8, strict=True):
        events = await read_events(redis, response_id)
        assert [event.sequence_number for event in events] == list(range(count))


async def test_one_round_trip_answers_each_append_for_itself(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch holding a fenced append, a repeated one, a cancelled response's and a plain one:
    each gets its own answer, and only the refused events are left out."""
    leases = Leases(redis, 30)
    ids = [f"resp_{uuid.uuid4().hex}" for _ in range(4)]
    held = [await leases.acquire(response_id, "a") for response_id in ids]
    assert all(lease is not None for lease in held)
    fenced, repeated, cancelled, plain = (lease for lease in held if lease is not None)
    log = EventLog(redis)
    assert await log.append(repeated, [encode(_events(0, 1)[0], 0)]) is AppendResult.OK
    round_trips = _round_trips(log, monkeypatch)
    await redis.delete(lease_key(fenced.response_id))
    await redis.set(cancel_key(cancelled.response_id), "1")
    appends = [
        log.append(fenced, [encode(event, index) for index, event in enumerate(_events(0, 2))]),
        log.append(repeated, [encode(event, index) for index, event in enumerate(_events(0, 2))]),
        log.append(cancelled, [encode(_events(0, 1)[0], 0)]),
        log.append(plain, [encode(event, index) for index, event in enumerate(_events(0, 3))]),
    ]
    results = await asyncio.gather(*appends, return_exceptions=True)
    assert round_trips == [4]
    assert results[0] is AppendResult.FENCED
    assert isinstance(results[1], ResponseError) and "equal or smaller" in str(results[1])
    assert results[2:] == [AppendResult.CANCEL_REQUESTED, AppendResult.OK]
    counts = [len(await read_events(redis, response_id)) for response_id in ids]
    assert counts == [0, 1, 1, 3]  # the repeat stopped at its first refused event


async def test_a_final_append_starts_the_retention_clock_of_the_responses_keys(redis: Redis) -> None:
    """An append with `retain_seconds` sets that TTL on the response's stream, attempt counter,
    cancel flag and observed mark in the same step; the other appends, and a fenced one, set none."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await Leases(redis, 5).acquire(response_id, "a")
    assert lease is not None
    await redis.set(cancel_key(response_id), "1")
    await redis.set(observed_key(response_id), "1")
    keys = [
        events_key(response_id),
        attempt_key(response_id),
        cancel_key(response_id),
        observed_key(response_id),
    ]
    log = EventLog(redis)
    assert await log.append(lease, [encode(_events(0, 1)[0], 0)]) is AppendResult.CANCEL_REQUESTED
    assert [await redis.ttl(key) for key in keys] == [-1] * 4
    stale = Lease(response_id, lease.attempt - 1, "gone")
    final = {"type": "response.completed", "response": {"id": response_id, "status": "completed"}}
    assert await log.append(stale, [encode(dict(final), 1)], retain_seconds=60) is AppendResult.FENCED
    assert [await redis.ttl(key) for key in keys] == [-1] * 4
    assert (
        await log.append(lease, [encode(dict(final), 1)], retain_seconds=60) is AppendResult.CANCEL_REQUESTED
    )
    ttls = [await redis.ttl(key) for key in keys]
    assert all(50 < ttl <= 60 for ttl in ttls), ttls
    await redis.delete(*keys, lease_key(response_id))


async def test_a_lease_is_taken_with_the_streams_newest_event(redis: Redis) -> None:
    """`acquire_reading` takes the lease and reads the stream's newest event in one step: none on
    an empty stream; the newest after appends; nothing (and no new attempt) while another holds it."""
    response_id = f"resp_{uuid.uuid4().hex}"
    leases = Leases(redis, 5)
    acquired = await leases.acquire_reading(response_id, "a")
    assert acquired is not None and acquired[1] is None
    first = acquired[0]
    assert first.attempt == 1
    await EventLog(redis).append(first, [encode(event, index) for index, event in enumerate(_events(0, 3))])
    assert await leases.acquire_reading(response_id, "b") is None
    await leases.release(first)
    acquired = await leases.acquire_reading(response_id, "b")
    assert acquired is not None and acquired[1] is not None
    second, newest = acquired
    assert second.attempt == 2
    assert decode_flat(*newest) == (await read_events(redis, response_id))[-1]
    await redis.delete(events_key(response_id), attempt_key(response_id), lease_key(response_id))


async def test_flushed_returns_once_every_append_submitted_before_it_was_told(redis: Redis) -> None:
    """An attempt that broke cannot settle its writer; whoever ends its stream waits at `flushed`
    for its last append, even one the batch interval still holds back, before reading where the
    stream ends."""
    leases = Leases(redis, 5)
    first, second = [await leases.acquire(f"resp_{uuid.uuid4().hex}", "a") for _ in range(2)]
    assert first is not None and second is not None
    log = EventLog(redis, batch_seconds=0.05)
    told: list[str] = []
    log.submit(first, [encode(_events(0, 1)[0], 0)], 0, lambda _: told.append("first"))
    log.submit(second, [encode(_events(0, 1)[0], 0)], 0, lambda _: told.append("second"))
    await log.append(second, [encode(_events(1, 1)[0], 1)])  # one round trip of three: the next waits 50 ms
    log.submit(first, [encode(_events(1, 1)[0], 1)], 0, lambda _: told.append("held back"))
    await log.flushed(first)
    assert told == ["first", "second", "held back"]
    assert [event.sequence_number for event in await read_events(redis, first.response_id)] == [0, 1]


async def test_a_final_append_can_leave_the_queue_in_the_same_step(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append `leaving` its queue takes its response out of the held set and drops its queued key
    and its lease, in the same script call as other responses' appends (before and after it); a
    fenced one leaves all of that as it was."""
    leases = Leases(redis, 30)
    ids = [f"resp_{uuid.uuid4().hex}" for _ in range(4)]
    held = [await leases.acquire(response_id, "a") for response_id in ids]
    before, ending, after, fenced = (lease for lease in held if lease is not None)
    queue = f"held-{uuid.uuid4().hex}"
    for response_id in ids:
        await redis.zadd(queue, {response_id: 1})
        await redis.set(f"queued-{response_id}", "q")
    await redis.delete(lease_key(fenced.response_id))
    log = EventLog(redis)
    assert await log.append(before, [encode(_events(0, 1)[0], 0)]) is AppendResult.OK  # the script loaded
    round_trips = _round_trips(log, monkeypatch)
    final = {"type": "response.completed", "response": {"status": "completed"}}
    appends = [
        log.append(before, [encode(_events(1, 1)[0], 1)]),
        log.append(ending, [encode(dict(final), 0)], 60, (queue, f"queued-{ending.response_id}")),
        log.append(after, [encode(event, index) for index, event in enumerate(_events(0, 2))]),
        log.append(fenced, [encode(dict(final), 0)], 60, (queue, f"queued-{fenced.response_id}")),
    ]
    results = await asyncio.gather(*appends)
    assert round_trips == [4]
    assert results == [AppendResult.OK, AppendResult.OK, AppendResult.OK, AppendResult.FENCED]
    assert [len(await read_events(redis, response_id)) for response_id in ids] == [2, 1, 2, 0]
    still_held = {member.decode() for member in await redis.zrange(queue, 0, -1)}
    assert still_held == {before.response_id, after.response_id, fenced.response_id}
    assert not await redis.exists(f"queued-{ending.response_id}", lease_key(ending.response_id))
    assert await redis.exists(f"queued-{fenced.response_id}", lease_key(before.response_id)) == 2
    assert await redis.ttl(events_key(ending.response_id)) > 0
