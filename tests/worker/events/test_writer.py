"""The writer's numbering through failed appends: a stream never gets a gap (DESIGN.md §3)."""

from __future__ import annotations

from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from worker.events.lease import Lease
from worker.events.stream import AppendResult, Event
from worker.events.writer import ResponseWriter

LEASE = Lease("resp_1", 1, "worker-a")


class ScriptedLog:
    """An event log at the writer's seam that answers each append as scripted, and records what landed."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.landed: list[int] = []

    async def append(self, lease: Lease, events: list[Event], retain_seconds: int = 0) -> AppendResult:
        answer = self.answers.pop(0) if self.answers else AppendResult.OK
        if isinstance(answer, Exception):
            raise answer
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
