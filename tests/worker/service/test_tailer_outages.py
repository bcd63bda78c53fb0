"""The tailer across a Redis outage, on a real Redis stopped and started again: its followers wait,
hearing of the silence, and go on gapless; only an outage past the bound, or a Redis back without
their streams, ends them."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from tests.support.outages import Restartable
from tests.worker.service.test_tailer import _append
from worker.connections import blocking_client, connect
from worker.events.stream import Event
from worker.service import tail_outage
from worker.service.tail_outage import TailLostError
from worker.service.tailer import Tailer

pytestmark = [pytest.mark.integration, pytest.mark.faults]

IDLE_SECONDS = 0.3


@pytest.fixture
async def redis(servers: Restartable) -> AsyncIterator[Redis]:
    if servers.redis is None:
        servers.start_redis()
    client = connect(servers.redis_url, max_connections=16, timeout_seconds=2)
    yield client
    await client.aclose(close_connection_pool=True)


async def _tailer(servers: Restartable, redis: Redis, outage_seconds: float) -> Tailer:
    blocking = blocking_client(servers.redis_url, 10, 2)
    tailer = Tailer(redis, blocking, block_ms=10_000, outage_seconds=outage_seconds, timeout_seconds=2)
    await tailer.start()
    return tailer


async def _live_follower(
    tailer: Tailer, redis: Redis, response_id: str, idle_seconds: float | None = IDLE_SECONDS
) -> AsyncIterator[Event | None]:
    """A follower of a new stream (its first event appended, as a create does), taken past its
    replay and its first live event: it is one of the tailer's subscribers."""
    await _append(redis, response_id, 0, "response.created")
    events = tailer.follow(response_id, idle_seconds=idle_seconds)
    first, _ = await _until_event(events, 10)
    assert first.sequence_number == 0
    live = asyncio.ensure_future(_until_event(events, 10))
    await asyncio.sleep(0.1)  # it subscribes, then waits
    await _append(redis, response_id, 1)
    second, _ = await live
    assert second.sequence_number == 1
    return events


async def _until_event(events: AsyncIterator[Event | None], seconds: float) -> tuple[Event, int]:
    """The next event, and how many idle cues (None) came before it."""
    idle = 0
    async with asyncio.timeout(seconds):
        while (item := await anext(events)) is None:
            idle += 1
    return item, idle


async def test_a_follower_waits_out_an_outage_and_goes_on_gapless(servers: Restartable, redis: Redis) -> None:
    """Redis stopped for 2 s and started on its data: the follower hears only idle cues meanwhile,
    no error, then every event after its cursor, once each, to the terminal one."""
    tailer = await _tailer(servers, redis, outage_seconds=30)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        events = await _live_follower(tailer, redis, response_id)
        await _append(redis, response_id, 2)
        event, _ = await _until_event(events, 5)
        assert event.sequence_number == 2
        servers.stop_redis()
        waiting = asyncio.ensure_future(_until_event(events, 30))
        await asyncio.sleep(2)
        assert not waiting.done()
        servers.start_redis()
        for sequence_number in (3, 4):
            await _append(redis, response_id, sequence_number)
        await _append(redis, response_id, 5, "response.completed")
        event, idle = await waiting
        assert event.sequence_number == 3
        assert idle >= 3  # the silence was heard of: an SSE relay's heartbeats went on
        rest = [item async for item in events if item is not None]
        assert [event.sequence_number for event in rest] == [4, 5]
    finally:
        await tailer.stop()


async def test_a_new_follow_during_an_outage_fails_at_once(servers: Restartable, redis: Redis) -> None:
    """While Redis is down, a new follower is refused with Redis's error, not left waiting."""
    tailer = await _tailer(servers, redis, outage_seconds=30)
    try:
        servers.stop_redis()
        async with asyncio.timeout(5):
            with pytest.raises(RedisError):
                await anext(tailer.follow(f"resp_{uuid.uuid4().hex}"))
    finally:
        servers.start_redis()
        await tailer.stop()


async def test_an_outage_past_the_bound_ends_followers_saying_how_long(
    servers: Restartable, redis: Redis
) -> None:
    """With a bound of 1 s, a follower across a longer outage ends with a resumable `TailLostError`
    naming the seconds Redis was away, after the bound and not before."""
    tailer = await _tailer(servers, redis, outage_seconds=1)
    try:
        events = await _live_follower(tailer, redis, f"resp_{uuid.uuid4().hex}")
        servers.stop_redis()
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(TailLostError) as caught:
            await _until_event(events, 10)
        assert loop.time() - began >= 1
        assert caught.value.is_resumable
        assert re.search(r"Redis was unreachable for \d+ s", str(caught.value))
        assert "RESPOOL_REDIS_OUTAGE_SECONDS" in str(caught.value)
    finally:
        servers.start_redis()
        await tailer.stop()


async def test_a_follower_whose_stream_redis_lost_ends(servers: Restartable, redis: Redis) -> None:
    """Redis back without its data: a follower of a stream it no longer has ends with a
    `TailLostError` that cannot be resumed, instead of waiting on a stream that never moves."""
    tailer = await _tailer(servers, redis, outage_seconds=30)
    try:
        events = await _live_follower(tailer, redis, f"resp_{uuid.uuid4().hex}")
        servers.stop_redis()
        waiting = asyncio.ensure_future(_until_event(events, 20))
        await asyncio.sleep(1)
        servers.start_redis(is_empty=True)
        with pytest.raises(TailLostError) as caught:
            await waiting
        assert not caught.value.is_resumable
        assert "lost its data" in str(caught.value)
    finally:
        await tailer.stop()


async def test_a_follower_whose_stream_began_anew_below_its_cursor_ends(
    servers: Restartable, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis back without its data, and the stream written anew before the tailer looks (as a
    recovery ends a lost response with its terminal event alone): its newest event comes before
    the follower's cursor, so the follower (one with no idle cues, as a foreground create's wait)
    ends instead of waiting for numbers that never come."""
    tailer = await _tailer(servers, redis, outage_seconds=30)
    lost_streams, may_look = tail_outage.lost_streams, asyncio.Event()

    async def after_the_rewrite(*args: Any) -> list[str]:
        await may_look.wait()
        return await lost_streams(*args)

    monkeypatch.setattr(tail_outage, "lost_streams", after_the_rewrite)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        events = await _live_follower(tailer, redis, response_id, idle_seconds=None)
        servers.stop_redis()
        waiting = asyncio.ensure_future(_until_event(events, 20))
        await asyncio.sleep(0.5)  # the tail's read fails: it waits for Redis
        servers.start_redis(is_empty=True)
        await _append(redis, response_id, 0, "response.failed")
        may_look.set()
        with pytest.raises(TailLostError) as caught:
            await waiting
        assert not caught.value.is_resumable
    finally:
        await tailer.stop()


async def test_a_follower_ends_when_a_restart_the_tail_never_saw_lost_its_stream(
    servers: Restartable, redis: Redis
) -> None:
    """Redis stopped and started empty while the loop runs nothing else (the tail's connection comes
    back at once, its read never fails), its stream written anew with its terminal event alone:
    the follower's next idle cue finds its stream lost, and it ends rather than waiting for ever."""
    tailer = await _tailer(servers, redis, outage_seconds=30)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        events = await _live_follower(tailer, redis, response_id)
        servers.stop_redis()
        servers.start_redis(is_empty=True)
        await _append(redis, response_id, 0, "response.failed")
        with pytest.raises(TailLostError) as caught:
            await _until_event(events, 10)
        assert not caught.value.is_resumable
    finally:
        await tailer.stop()


async def test_a_quiet_follower_is_not_taken_for_lost(servers: Restartable, redis: Redis) -> None:
    """A follower of a stream that exists but is quiet, even one whose cursor is past its end (a
    client's `starting_after` ahead of a live response), hears idle cues and nothing else, then
    the events after its cursor when they come."""
    tailer = await _tailer(servers, redis, outage_seconds=30)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        await _append(redis, response_id, 0, "response.created")
        events = tailer.follow(response_id, after=2, idle_seconds=IDLE_SECONDS)
        waiting = asyncio.ensure_future(_until_event(events, 10))
        await asyncio.sleep(4 * IDLE_SECONDS)
        for sequence_number in (1, 2, 3):
            await _append(redis, response_id, sequence_number)
        event, idle = await waiting
        assert (event.sequence_number, idle >= 2) == (3, True)
    finally:
        await tailer.stop()
