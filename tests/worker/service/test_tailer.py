"""The tailer on a real Redis: a lone stream's events relayed at once, many streams' read together."""

from __future__ import annotations

import asyncio
import gc
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.support.stack import Servers
from worker.connections import blocking_client
from worker.events.stream import Event, encode, entry_id
from worker.keys import events_key
from worker.service import tailer as tailer_module
from worker.service.tailer import Passthrough, Tailer

pytestmark = pytest.mark.integration


async def _tailer(backing: Servers, redis: Redis, batch_seconds: float) -> Tailer:
    tailer = Tailer(
        redis, blocking_client(backing.redis_url, 10, 5), block_ms=10_000, batch_seconds=batch_seconds
    )
    await tailer.start()
    return tailer


def add_events(pipe: Any, response_id: str, events: list[Event]) -> None:
    """Unfenced XADDs on a pipeline, as the API's create writes a stream's first events."""
    for event in events:
        pipe.xadd(
            events_key(response_id), {"t": event.type, "d": event.data}, id=entry_id(event.sequence_number)
        )


async def _append(
    redis: Redis, response_id: str, sequence_number: int, kind: str = "response.output_text.delta"
) -> None:
    event = encode({"type": kind, "delta": "x"}, sequence_number)
    async with redis.pipeline(transaction=False) as pipe:
        add_events(pipe, response_id, [event])
        await pipe.execute()


async def _next(events: AsyncIterator[Event | None]) -> Event:
    event = await asyncio.wait_for(anext(events), 10)
    assert event is not None
    return event


async def _followed_past_its_start(
    tailer: Tailer, redis: Redis, response_id: str
) -> AsyncGenerator[Event | None]:
    """A follower of a new stream, past its first event (the replay's): its next read is live."""
    await _append(redis, response_id, 0, "response.created")
    events = tailer.follow(response_id)
    assert (await _next(events)).sequence_number == 0
    return events


async def test_a_lone_stream_is_relayed_event_by_event_without_waiting(
    backing: Servers, redis: Redis
) -> None:
    """Each read brings one event, so none waits out the interval: with an hour's, all 20 come."""
    tailer = await _tailer(backing, redis, batch_seconds=3600)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        await _append(redis, response_id, 0, "response.created")
        events = tailer.follow(response_id)
        assert (await _next(events)).sequence_number == 0
        for sequence_number in range(1, 21):
            await _append(redis, response_id, sequence_number)
            assert (await _next(events)).sequence_number == sequence_number
        await events.aclose()
    finally:
        await tailer.stop()


async def test_a_lone_stream_whose_events_come_together_waits_for_nothing(
    backing: Servers, redis: Redis
) -> None:
    """A read that brings several events of one stream (a response's first ones come together) is
    followed at once: with an hour's interval, the next event still comes."""
    tailer = await _tailer(backing, redis, batch_seconds=3600)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        events = await _followed_past_its_start(tailer, redis, response_id)
        waiting = asyncio.ensure_future(_next(events))
        await asyncio.sleep(0.2)  # the follower is live: the tailer blocks on its stream
        async with redis.pipeline(transaction=True) as pipe:  # two events at once: one read of two
            add_events(pipe, response_id, [encode({"type": "response.in_progress"}, n) for n in (1, 2)])
            await pipe.execute()
        assert (await waiting).sequence_number == 1
        assert (await _next(events)).sequence_number == 2
        await _append(redis, response_id, 3)
        assert (await _next(events)).sequence_number == 3
        await events.aclose()
    finally:
        await tailer.stop()


async def test_a_new_response_is_followed_from_its_first_event_without_a_read_before(
    backing: Servers, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A response its create follows (`is_new`: marked observed at its enqueue) is read by the live
    tail alone, from its first event: what was appended before the follow began, then what comes."""
    tailer = await _tailer(backing, redis, batch_seconds=0.0)

    async def no_read(*args: object, **kwargs: object) -> list[Event]:
        raise AssertionError("a new response's follow reads nothing before the live tail")

    monkeypatch.setattr(tailer_module, "read_events_observed", no_read)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        for sequence_number in (0, 1):
            await _append(redis, response_id, sequence_number, "response.created")
        events = tailer.follow(response_id, is_new=True)
        assert [(await _next(events)).sequence_number for _ in range(2)] == [0, 1]
        await _append(redis, response_id, 2)
        await _append(redis, response_id, 3, "response.completed")
        assert [(await _next(events)).sequence_number for _ in range(2)] == [2, 3]
        with pytest.raises(StopAsyncIteration):  # it ends at the terminal event
            await anext(events)
    finally:
        await tailer.stop()


async def test_under_load_one_read_brings_many_streams_events(
    backing: Servers, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a read that brought events of more than one stream, the next waits out the interval
    and brings what every stream appended meanwhile, to each follower in order."""
    tailer = await _tailer(backing, redis, batch_seconds=2.0)
    reads: list[int] = []
    read_once = tailer._read_once
    may_read = asyncio.Event()
    may_read.set()

    async def counted() -> int:
        await may_read.wait()
        brought = await read_once()
        if brought:
            reads.append(brought)
        return brought

    monkeypatch.setattr(tailer, "_read_once", counted)
    try:
        ids = [f"resp_{uuid.uuid4().hex}" for _ in range(3)]
        followers = [await _followed_past_its_start(tailer, redis, response_id) for response_id in ids]
        waiting = [asyncio.ensure_future(_next(events)) for events in followers]
        await asyncio.sleep(0.2)  # the followers are live: the tailer blocks on their streams
        may_read.clear()  # the read under way brings one stream's event; the next waits for `may_read`
        await _append(redis, ids[0], 1)
        assert (await waiting[0]).sequence_number == 1
        for response_id in ids[1:]:  # two streams' events before the next read: it brings both
            await _append(redis, response_id, 1)
        may_read.set()
        for first in waiting[1:]:
            assert (await first).sequence_number == 1
        for offset in (2, 3):  # then six appends 5 ms apart, within the interval: one read
            for response_id in ids:
                await _append(redis, response_id, offset)
                await asyncio.sleep(0.005)
        got = [[(await _next(events)).sequence_number for _ in range(2)] for events in followers]
        assert got == [[2, 3]] * 3
        assert reads == [1, 2, 3]
        for events in followers:
            await events.aclose()
    finally:
        await tailer.stop()


async def test_a_follower_hears_of_silence_only_when_there_is_some(backing: Servers, redis: Redis) -> None:
    """Events closer together than `idle_seconds` bring no idle cue; a silence of twice that does,
    as `None`, and the stream goes on after it."""
    tailer = await _tailer(backing, redis, batch_seconds=0.0)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        await _append(redis, response_id, 0, "response.created")
        events = tailer.follow(response_id, idle_seconds=0.4)
        assert (await _next(events)).sequence_number == 0
        for sequence_number in range(1, 16):  # 1.5 s of events 0.1 s apart
            await asyncio.sleep(0.1)
            await _append(redis, response_id, sequence_number)
            assert (await _next(events)).sequence_number == sequence_number
        await asyncio.sleep(0.9)
        assert await asyncio.wait_for(anext(events), 1) is None
        await _append(redis, response_id, 16, "response.completed")
        assert (await _next(events)).type == "response.completed"
        await events.aclose()
    finally:
        await tailer.stop()


async def test_followers_that_join_while_a_wake_up_is_on_its_way_send_none(
    backing: Servers, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower joining while a wake-up is on its way sends none of its own: the read that wake-up
    ends is followed by one that has its stream too. Twenty join while the first one's is held:
    one wake-up, and each hears its next event long before the read's 10 s block would end."""
    tailer = await _tailer(backing, redis, batch_seconds=0)
    poke, held, pokes = tailer._poke, asyncio.Event(), []

    async def held_poke() -> bytes:
        pokes.append(1)
        await held.wait()
        return await poke()

    monkeypatch.setattr(tailer, "_poke", held_poke)
    try:
        ids = [f"resp_{uuid.uuid4().hex}" for _ in range(20)]
        followers = [await _followed_past_its_start(tailer, redis, response_id) for response_id in ids]
        waiting = [asyncio.ensure_future(_next(events)) for events in followers]  # each goes live
        await asyncio.sleep(0.2)
        assert len(pokes) == 1
        held.set()
        await asyncio.sleep(0.2)
        for response_id in ids:
            await _append(redis, response_id, 1)
        got = await asyncio.wait_for(asyncio.gather(*waiting), 3)
        assert [event.sequence_number for event in got] == [1] * len(ids)
        assert len(pokes) == 1
        for events in followers:
            await events.aclose()
    finally:
        await tailer.stop()


async def test_the_wake_up_stream_expires_if_its_process_dies(backing: Servers, redis: Redis) -> None:
    """The wake-up stream has an expiry from the tailer's start, kept as followers poke it."""
    tailer = await _tailer(backing, redis, batch_seconds=0)
    try:
        assert await redis.ttl(tailer._wake) > 0
        response_id = f"resp_{uuid.uuid4().hex}"
        events = await _followed_past_its_start(tailer, redis, response_id)
        waiting = asyncio.ensure_future(_next(events))
        await asyncio.sleep(0.1)
        await _append(redis, response_id, 1)
        assert (await waiting).sequence_number == 1
        assert await redis.ttl(tailer._wake) > 0
        await events.aclose()
    finally:
        await tailer.stop()


class _Written:
    """A passthrough's writes: the numbers written, and refused once those in `refuse`."""

    def __init__(self, refuse: set[int]) -> None:
        self.numbers: list[int] = []
        self.refuse = refuse
        self.changed = asyncio.Event()

    def write(self, event: Event) -> bool:
        if event.sequence_number in self.refuse:
            self.refuse.discard(event.sequence_number)
            return False
        self.numbers.append(event.sequence_number)
        self.changed.set()
        return True

    async def until(self, numbers: list[int]) -> None:
        async with asyncio.timeout(10):
            while self.numbers != numbers:
                self.changed.clear()
                await self.changed.wait()


async def test_a_waiting_followers_live_events_pass_through_and_its_end_is_yielded(
    backing: Servers, redis: Redis
) -> None:
    """With a passthrough that writes, each live event its follower waits for is written by it from
    the tailer's read (none is yielded); the terminal event is yielded, and ends the follow. An
    event the passthrough refuses (its client slow to read) is yielded, and so is every event after
    it, in order, until the follower has taken them; then events pass through again."""
    tailer = await _tailer(backing, redis, batch_seconds=0.0)
    written = _Written(refuse={3})
    through = Passthrough()
    through.write = written.write
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        await _append(redis, response_id, 0, "response.created")
        events = tailer.follow(response_id, passthrough=through)
        assert (await _next(events)).sequence_number == 0  # replayed: yielded
        waiting = asyncio.ensure_future(_next(events))
        await asyncio.sleep(0.2)  # the follower is live, and waits
        for sequence_number in (1, 2):
            await _append(redis, response_id, sequence_number)
        await written.until([1, 2])
        assert not waiting.done()
        async with redis.pipeline(transaction=True) as pipe:  # one read: 3 refused, so 4 after it
            delta = {"type": "response.output_text.delta", "delta": "x"}
            add_events(pipe, response_id, [encode(dict(delta), n) for n in (3, 4)])
            await pipe.execute()
        assert (await waiting).sequence_number == 3
        assert (await _next(events)).sequence_number == 4
        waiting = asyncio.ensure_future(_next(events))
        await asyncio.sleep(0.1)  # waiting again
        await _append(redis, response_id, 5)
        await written.until([1, 2, 5])
        await _append(redis, response_id, 6, "response.completed")
        assert (await waiting).type == "response.completed"
        with pytest.raises(StopAsyncIteration):
            await anext(events)
        assert written.numbers == [1, 2, 5]
    finally:
        await tailer.stop()


async def test_a_finished_responses_end_appended_after_its_replay_read_is_relayed(
    backing: Servers, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished response (its row ended) whose writer appends its last events and terminal event
    between the replay's read and the look at the stream's newest event: those events are relayed,
    up to the terminal one, not dropped (the stream seemed to end without its end: seen in CI)."""
    tailer = await _tailer(backing, redis, batch_seconds=0.0)
    newest = tailer_module.last_event

    async def after_the_writer_ended_it(redis_: Redis, response_id: str) -> Event | None:
        await _append(redis, response_id, 2)
        await _append(redis, response_id, 3, "response.completed")
        return await newest(redis_, response_id)

    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        await _append(redis, response_id, 0, "response.created")
        await _append(redis, response_id, 1)
        monkeypatch.setattr(tailer_module, "last_event", after_the_writer_ended_it)
        events = tailer.follow(response_id, is_finished=True)
        got = [event.sequence_number async for event in events if event is not None]
        assert got == [0, 1, 2, 3]
    finally:
        await tailer.stop()


async def test_the_wait_for_a_terminal_event_closes_its_follow_itself(backing: Servers, redis: Redis) -> None:
    """A foreground create's wait (`terminal`): its follow ends where the terminal event came, not
    later by the loop's finalizer hook (a generator left to the collector is closed by a task of its
    own, which the hook wakes the loop through its eventfd to start)."""
    tailer = await _tailer(backing, redis, batch_seconds=0)
    firstiter, finalizer = sys.get_asyncgen_hooks()
    left: list[str] = []

    def finalize(generator: AsyncGenerator[Any]) -> None:
        left.append(generator.__qualname__)
        if finalizer is not None:
            finalizer(generator)

    sys.set_asyncgen_hooks(firstiter, finalize)
    try:
        response_id = f"resp_{uuid.uuid4().hex}"
        await _append(redis, response_id, 0, "response.created")
        waiting = asyncio.create_task(tailer.terminal(response_id, is_new=True))
        await asyncio.sleep(0.05)  # it follows, live
        await _append(redis, response_id, 1, "response.in_progress")
        await _append(redis, response_id, 2, "response.completed")
        terminal = await asyncio.wait_for(waiting, 10)
        assert terminal is not None and terminal.sequence_number == 2
        gc.collect()
        assert "Tailer.follow" not in left
    finally:
        sys.set_asyncgen_hooks(firstiter, finalizer)
        await tailer.stop()
