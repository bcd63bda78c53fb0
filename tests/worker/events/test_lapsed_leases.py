"""Leases that lapsed while Redis was unreachable: taken again by compare-and-set on the attempt.

A lease lapses on the wall clock whether or not its holder could renew it; what says whether anyone
else may have written meanwhile is the attempt counter, which only an acquire counts up. These run
on the test Redis, a lapse made by deleting the lease as its expiry would.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from worker.errors import FencedOutError
from worker.events.lease import Leases
from worker.events.stream import EventLog, read_events
from worker.events.writer import ResponseWriter
from worker.keys import attempt_key, events_key, lease_key

pytestmark = pytest.mark.integration


def _rid() -> str:
    return f"resp_{uuid.uuid4().hex}"


async def test_a_lapsed_lease_is_taken_again_only_when_asked_and_no_later_attempt_started(
    redis: Redis,
) -> None:
    leases = Leases(redis, 5)
    ours, theirs = _rid(), _rid()
    mine = await leases.acquire(ours, "worker-a")
    taken_over = await leases.acquire(theirs, "worker-a")
    assert mine is not None and taken_over is not None
    for rid in (ours, theirs):
        await redis.xadd(events_key(rid), {"t": "response.created", "d": "{}"}, id="0-1")
    await redis.delete(lease_key(ours), lease_key(theirs))  # both lapsed
    assert await leases.acquire(theirs, "worker-b") is not None  # a later attempt started on one

    assert await leases.renew([mine, taken_over]) == ([mine, taken_over], [])  # not asked: both lost
    assert await leases.renew([mine, taken_over], reclaim=True) == ([taken_over], [mine])
    assert (await redis.get(lease_key(ours))).decode() == mine.value
    assert (await redis.get(lease_key(theirs))).decode().endswith(":worker-b")
    assert await leases.renew([mine]) == ([], [])  # renewed as any held lease


async def test_a_counter_a_failover_lost_is_set_back_so_a_later_acquire_still_fences(redis: Redis) -> None:
    leases = Leases(redis, 5)
    rid = _rid()
    held = await leases.acquire(rid, "worker-a")
    assert held is not None
    await redis.xadd(events_key(rid), {"t": "response.created", "d": "{}"}, id="0-1")
    await redis.delete(lease_key(rid), attempt_key(rid))  # a replica promoted before it had either
    assert await leases.reclaim(held)
    assert int(await redis.get(attempt_key(rid))) == held.attempt
    await redis.delete(lease_key(rid))
    later = await leases.acquire(rid, "worker-b")
    assert later is not None and later.attempt == held.attempt + 1
    assert not await leases.reclaim(held)


async def test_a_lease_whose_stream_is_gone_is_not_taken_again(redis: Redis) -> None:
    """A Redis that came back without its data lost what the attempt had told: its lease stays lost."""
    leases = Leases(redis, 5)
    rid = _rid()
    held = await leases.acquire(rid, "worker-a")
    assert held is not None
    await redis.delete(lease_key(rid), attempt_key(rid), events_key(rid))
    assert await leases.renew([held], reclaim=True) == ([held], [])


async def test_a_writer_whose_lease_lapsed_appends_again_once_it_is_taken_again(redis: Redis) -> None:
    """An append fenced out by a lapsed lease goes again, with its numbers, once the writer's
    `reclaim` takes the lease back; one fenced out by a later attempt stays fenced out."""
    leases = Leases(redis, 5)
    rid = _rid()
    lease = await leases.acquire(rid, "worker-a")
    assert lease is not None
    writer = ResponseWriter(EventLog(redis), lease, next_sequence=0, patience=1.0, reclaim=leases.reclaim)
    await writer.emit([{"type": "response.created"}])
    await redis.delete(lease_key(rid))
    writer.send([{"type": "response.in_progress"}])
    await writer.drain()
    await redis.delete(lease_key(rid))
    await writer.emit([{"type": "response.output_item.added"}])
    assert [event.sequence_number for event in await read_events(redis, rid)] == [0, 1, 2]

    await redis.delete(lease_key(rid))
    assert await leases.acquire(rid, "worker-b") is not None
    writer.send([{"type": "response.output_text.delta", "delta": "x"}])
    with pytest.raises(FencedOutError):
        async with asyncio.timeout(5):
            await writer.drain()
    assert len(await read_events(redis, rid)) == 3
