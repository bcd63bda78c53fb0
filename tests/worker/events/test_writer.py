"""The writer's numbering through failed appends: a stream never gets a gap (DESIGN.md §3)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from worker.errors import CancelRequestedError, FencedOutError
from worker.events.lease import Lease, Leases
from worker.events.stream import AppendResult, Event, EventLog, Leaving, read_events
from worker.events.writer import DEFERRED_MOST, RedisOutlastedError, ResponseWriter, end_stream
from worker.translation.output import output_items, tell_whole

LEASE = Lease("resp_1", 1, "worker-a")


class ScriptedLog:
    """An event log at the writer's seam that answers each append as scripted, and records what
    landed. `submit`'s appends are answered when the test says (`answer`), as a round trip would."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.landed: list[int] = []
        self.batches: list[list[str]] = []  # what each submitted append carried: event types or deltas
        self.emitted: list[list[str]] = []  # likewise, each append waited for (`emit`)
        self.waiting: list[tuple[list[Event], Callable[[Any], object]]] = []

    async def append(
        self, lease: Lease, events: list[Event], retain_seconds: int = 0, leaving: Leaving | None = None
    ) -> AppendResult:
        self.emitted.append([event.payload().get("delta", event.type) for event in events])
        answer = self._answer(events)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def submit(
        self, lease: Lease, events: list[Event], retain_seconds: int, done: Callable[[Any], object]
    ) -> None:
        self.batches.append([event.payload().get("delta", event.type) for event in events])
        self.waiting.append((events, done))

    def answer(self) -> None:
        """The round trip of every append submitted so far comes back."""
        waiting, self.waiting = self.waiting, []
        for events, done in waiting:
            done(self._answer(events))

    def _answer(self, events: list[Event]) -> AppendResult | Exception:
        answer = self.answers.pop(0) if self.answers else AppendResult.OK
        if isinstance(answer, Exception):
            return answer
        if answer is not AppendResult.FENCED:
            self.landed += [event.sequence_number for event in events]
        return AppendResult(answer)


def _delta(text: str) -> dict[str, Any]:
    return {"type": "response.output_text.delta", "delta": text}


async def test_a_failed_append_leaves_no_gap() -> None:
    """An append that fails for good does not use up its numbers: whatever the writer appends next follows on."""
    log = ScriptedLog(RedisConnectionError("down"))
    writer = ResponseWriter(log, LEASE, next_sequence=7)  # type: ignore[arg-type]
    with pytest.raises(RedisConnectionError):
        await writer.emit([_delta("a"), _delta("b")])
    await writer.emit([{"type": "response.failed", "response": {}}], final=True)
    assert log.landed == [7]


async def test_an_append_is_retried_while_redis_is_briefly_away() -> None:
    """Within its patience the writer retries an append that met an unreachable Redis, with the same numbers."""
    log = ScriptedLog(RedisConnectionError("down"), RedisConnectionError("down"), AppendResult.OK)
    writer = ResponseWriter(log, LEASE, next_sequence=3, patience=5.0)  # type: ignore[arg-type]
    await writer.emit([_delta("a"), _delta("b")])
    assert (log.landed, writer.next_sequence) == ([3, 4], 5)


async def test_an_append_that_already_landed_counts_as_written() -> None:
    """A repeat refused as "equal or smaller" (its first try's reply was lost) counts as written."""
    refused = ResponseError(
        "ERR The ID specified in XADD is equal or smaller than the target stream top item"
    )
    writer = ResponseWriter(ScriptedLog(refused), LEASE, next_sequence=3)  # type: ignore[arg-type]
    await writer.emit([_delta("a")])
    assert writer.next_sequence == 4


async def test_what_is_sent_while_an_append_is_in_flight_goes_in_the_next_one_merged() -> None:
    """`send` hands the first batch over at once; what comes while it is in flight waits, its deltas
    joined, and goes once the first lands; `drain` returns once everything landed, numbered in order."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=5)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    writer.send([_delta("b")])
    writer.send([_delta("c"), {"type": "response.output_text.done"}])
    assert log.batches == [["a"]]
    draining = asyncio.create_task(writer.drain())
    await asyncio.sleep(0)
    assert not draining.done()
    log.answer()
    assert log.batches == [["a"], ["bc", "response.output_text.done"]]
    await asyncio.sleep(0)
    assert not draining.done()
    log.answer()
    await draining
    assert (log.landed, writer.next_sequence) == ([5, 6, 7], 8)


async def test_a_deferring_writer_appends_what_was_sent_only_when_waited_on() -> None:
    """Deferring (a foreground response not streamed), a writer keeps what is sent, however many
    sends; a `drain` appends it all in one append, deltas merged, in order."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=2)  # type: ignore[arg-type]
    writer.defer()
    writer.send([{"type": "response.in_progress"}])
    writer.send([_delta("a")])
    writer.send([_delta("b"), {"type": "response.output_text.done"}])
    await asyncio.sleep(0)
    assert log.batches == []
    draining = asyncio.create_task(writer.drain())
    await asyncio.sleep(0)
    assert log.batches == [["response.in_progress", "ab", "response.output_text.done"]]
    assert not draining.done()
    log.answer()
    await draining
    assert (log.landed, writer.next_sequence) == ([2, 3, 4], 5)


async def test_a_deferring_writer_appends_what_waits_before_what_it_emits() -> None:
    """An `emit` on a deferring writer lands what was sent first, then its own events after it."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.defer()
    writer.send([_delta("a")])
    emitting = asyncio.create_task(writer.emit([{"type": "response.output_text.done"}]))
    await asyncio.sleep(0)
    assert log.batches == [["a"]]
    log.answer()
    await emitting
    assert (log.landed, writer.next_sequence) == ([0, 1], 2)


async def test_a_deferring_writer_appends_once_enough_waits() -> None:
    """However long the turn, a deferring writer holds at most DEFERRED_MOST events."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.defer()
    for index in range(DEFERRED_MOST - 1):
        writer.send([{"type": "response.output_item.added", "output_index": index}])
    assert log.batches == []
    writer.send([{"type": "response.output_item.added", "output_index": DEFERRED_MOST}])
    assert [len(batch) for batch in log.batches] == [DEFERRED_MOST]


async def test_a_turn_that_told_no_output_keeps_it_for_the_end() -> None:
    """The upstream's last read held (`hold`): nothing of it is appended, nor at the turn's end while
    no output has landed (`end_turn`); the final `emit` appends it with the terminal event, one append,
    deltas merged, numbered on from what landed."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=2)  # type: ignore[arg-type]
    writer.send([{"type": "response.in_progress"}])
    log.answer()
    writer.hold()
    writer.send([{"type": "response.output_item.added"}, _delta("a")])
    writer.send([_delta("b"), {"type": "response.output_item.done"}])
    await writer.end_turn()
    assert log.batches == [["response.in_progress"]]
    await writer.emit([{"type": "response.completed"}], final=True)
    assert log.emitted == [
        ["response.output_item.added", "ab", "response.output_item.done", "response.completed"]
    ]
    assert (log.landed, writer.next_sequence) == ([2, 3, 4, 5, 6], 7)


async def test_a_turn_whose_output_landed_keeps_its_last_read_for_the_end() -> None:
    """Output landed already (the upstream's reads came apart): a turn's end waits for what is in
    flight, then keeps what its last read brought; the final `emit` appends that with the terminal
    event, one append where the last read and the terminal event cost two."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    writer.hold()
    writer.send([_delta("b")])
    ending = asyncio.create_task(writer.end_turn())
    await asyncio.sleep(0)
    assert log.batches == [["a"]] and not ending.done()  # what is in flight lands first
    log.answer()
    await ending
    assert log.batches == [["a"]]
    await writer.emit([{"type": "response.completed"}], final=True)
    assert log.emitted == [["b", "response.completed"]]
    assert log.landed == [0, 1, 2]


async def test_a_turns_end_raises_what_its_batch_in_flight_met() -> None:
    """A fence met by the batch in flight at a turn's end is raised there, before any commit."""
    log = ScriptedLog(AppendResult.FENCED)
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.send([{"type": "response.in_progress"}])
    writer.hold()
    writer.send([_delta("a")])
    ending = asyncio.create_task(writer.end_turn())
    await asyncio.sleep(0)
    log.answer()
    with pytest.raises(FencedOutError):
        await ending
    assert log.batches == [["response.in_progress"]]


async def test_what_a_turn_kept_goes_with_the_next_send() -> None:
    """A turn that kept its last read, followed by more (a tool loop's next step, whose progress a
    client may be following): the next `send` appends what was kept with it, at once."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.hold()
    writer.send([{"type": "response.output_item.added"}])
    await writer.end_turn()
    assert log.batches == []
    writer.send([{"type": "response.mcp_call.in_progress"}])
    assert log.batches == [["response.output_item.added", "response.mcp_call.in_progress"]]


async def test_what_a_held_writer_keeps_goes_before_a_later_emit() -> None:
    """A turn that kept its last read (no output landed) and is followed by more (a tool loop's next
    step) appends what it kept first, in order, with the next `emit`."""
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.hold()
    writer.send([_delta("a")])
    await writer.end_turn()
    emitting = asyncio.create_task(writer.emit([{"type": "response.output_item.done"}]))
    await asyncio.sleep(0)
    assert log.batches == [["a"]]
    log.answer()
    await emitting
    assert log.emitted == [["response.output_item.done"]]
    assert (log.landed, writer.next_sequence) == ([0, 1], 2)


async def test_a_fenced_append_is_raised_once_and_what_waited_is_not_sent() -> None:
    log = ScriptedLog(AppendResult.FENCED)
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    writer.send([_delta("b")])
    log.answer()
    with pytest.raises(FencedOutError):
        await writer.drain()
    assert log.batches == [["a"]] and log.landed == []
    await writer.drain()  # raised once


async def test_a_sent_append_is_retried_while_redis_is_briefly_away_then_given_up() -> None:
    """Within its patience a sent batch goes again with the same numbers; past it, the outage is
    raised by the next `send`, and the numbers are not used up."""
    log = ScriptedLog(RedisConnectionError("down"), AppendResult.OK)
    writer = ResponseWriter(log, LEASE, next_sequence=3, patience=5.0)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    log.answer()
    await asyncio.sleep(0.15)  # the first backoff
    assert log.batches == [["a"], ["a"]]
    log.answer()
    await writer.drain()
    assert (log.landed, writer.next_sequence) == ([3], 4)
    impatient = ResponseWriter(
        ScriptedLog(RedisConnectionError("down")), LEASE, next_sequence=3, patience=0.05
    )  # type: ignore[arg-type]
    impatient.send([_delta("a")])
    impatient.log.answer()  # type: ignore[attr-defined]
    with pytest.raises(RedisOutlastedError) as outlasted:
        impatient.send([_delta("b")])
    assert isinstance(outlasted.value.__cause__, RedisConnectionError)
    assert impatient.next_sequence == 3


async def test_a_cancel_request_is_raised_after_the_batch_landed() -> None:
    log = ScriptedLog(AppendResult.CANCEL_REQUESTED)
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    log.answer()
    with pytest.raises(CancelRequestedError):
        writer.send([_delta("b")])
    assert writer.next_sequence == 1


async def test_an_abandoned_writer_sends_nothing_more_of_what_waited() -> None:
    log = ScriptedLog()
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    writer.send([_delta("b")])
    await writer.abandon()
    log.answer()  # the one in flight still lands
    assert log.batches == [["a"]] and writer.next_sequence == 1
    await writer.settle()


async def test_a_writer_abandoned_while_its_append_waits_to_go_again_can_still_end_the_stream() -> None:
    """An append that met an outage waits out its backoff; the attempt is abandoned meanwhile (a
    cancel, a stop). The batch is given up, not sent again, and the writer's own awaited appends
    (the closing events) go at once, numbered where the stream ends, with no failure left over."""
    log = ScriptedLog(RedisConnectionError("down"))
    writer = ResponseWriter(log, LEASE, next_sequence=4, patience=5.0)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    log.answer()  # the outage: a resubmit is due in 0.1 s
    await writer.abandon()
    await asyncio.sleep(0.15)
    assert log.batches == [["a"]]  # not sent again
    async with asyncio.timeout(1):
        await writer.emit([{"type": "response.failed", "response": {}}], final=True)
    assert (log.landed, writer.next_sequence) == ([4], 5)


async def test_what_an_abandoned_writers_last_append_met_is_not_raised() -> None:
    log = ScriptedLog(AppendResult.FENCED)
    writer = ResponseWriter(log, LEASE, next_sequence=0)  # type: ignore[arg-type]
    writer.send([_delta("a")])
    await writer.abandon()
    log.answer()
    await writer.drain()  # nothing raised: the attempt that sent it is over


class LateLog(EventLog):
    """The real event log on a real Redis, whose first append's outcome reaches its writer only when
    the test says: its events are in the stream, the round trip's reply not yet counted (as when the
    reply of a read sent after it is handled first)."""

    def __init__(self, redis: Redis) -> None:
        super().__init__(redis)
        self.told: list[tuple[Callable[[Any], object], Any]] = []
        self.landed = asyncio.Event()

    def submit(
        self,
        lease: Lease,
        events: list[Event],
        retain_seconds: int,
        done: Callable[[Any], object],
        leaving: Leaving | None = None,
    ) -> None:
        if self.landed.is_set():
            super().submit(lease, events, retain_seconds, done, leaving)
        else:
            super().submit(lease, events, retain_seconds, partial(self._hold, done), leaving)

    def _hold(self, done: Callable[[Any], object], outcome: Any) -> None:
        self.told.append((done, outcome))
        self.landed.set()

    def release(self) -> None:
        for done, outcome in self.told:
            done(outcome)


@pytest.mark.integration
async def test_a_stream_is_ended_after_an_abandoned_batch_that_landed_uncounted(redis: Redis) -> None:
    """A cancel ends an attempt whose last batch is in the stream but not yet counted by its writer;
    the stream is then ended as stored. Its terminal event follows that batch with no gap (read
    before the count, the stream's end gave `... 12, 16`: the batch's three numbers skipped)."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await Leases(redis, 5).acquire(response_id, "worker-a")
    assert lease is not None
    log = LateLog(redis)
    writer = ResponseWriter(log, lease, next_sequence=0)
    writer.send(
        [
            {"type": kind}
            for kind in ("response.created", "response.in_progress", "response.output_item.added")
        ]
    )
    async with asyncio.timeout(5):
        await log.landed.wait()
    await writer.abandon()
    ending = asyncio.create_task(end_stream(writer, {"id": response_id, "status": "cancelled"}, 60))
    await asyncio.sleep(0.05)  # whatever the ending reads meanwhile, the batch is not yet counted
    log.release()
    await ending
    told = await read_events(redis, response_id)
    assert [(event.sequence_number, event.type) for event in told] == [
        (0, "response.created"),
        (1, "response.in_progress"),
        (2, "response.output_item.added"),
        (3, "response.failed"),
    ]


@pytest.mark.integration
@pytest.mark.parametrize("told_text", [None, "", "kept ", "kept whole", "done"])
async def test_a_stream_is_told_the_output_it_had_not_told_before_its_end(
    redis: Redis, told_text: str | None
) -> None:
    """A response whose end was committed while its last append (the rest of its output, with its
    terminal event) was lost: whoever ends its stream from the stored Response tells what the stream
    had not told of that output before the terminal event, after what it had, so the stream adds up
    to the Response (DESIGN.md §4): all of it when it told none, the rest of a part it had begun, and
    nothing when it had told it all. `told_text`: None, no item told; else the message added and that
    much of its text told ("done": the message told to its end)."""
    from worker.translation.replay import rebuild

    text = "kept whole"
    message = {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }
    whole = tell_whole([message])
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await Leases(redis, 5).acquire(response_id, "worker-a")
    assert lease is not None
    writer = ResponseWriter(EventLog(redis), lease, next_sequence=0)
    opening: list[dict[str, Any]] = [{"type": "response.created"}, {"type": "response.in_progress"}]
    if told_text == "done":
        opening += whole
    elif told_text is not None:
        opening += whole[:2]  # the item and its part added
        if told_text:
            opening.append({**whole[2], "delta": told_text})
    await writer.emit(opening)
    response = {"id": response_id, "status": "completed", "output": [message]}
    await end_stream(writer, response, 60)
    told = await read_events(redis, response_id)
    assert [event.sequence_number for event in told] == list(range(len(told)))
    assert told[-1].type == "response.completed"
    payloads = [event.payload() for event in told]
    assert output_items(rebuild(payloads)) == [message]
    assert "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta") == text
    rest = [event.type for event in told[len(opening) : -1]]
    if told_text == "done":
        assert rest == []
        return
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    if told_text == "kept whole":  # all its text told: the part goes on to its end
        assert rest == closing
    elif told_text is None:
        assert rest == [*[e["type"] for e in whole[:3]], *closing]
    else:
        assert rest == ["response.output_text.delta", *closing]
