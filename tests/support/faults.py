"""What every fault-injection test checks, and the means to inject faults into real processes.

Owns `check_ended`: the invariants a response must keep whatever crashed (issue 4): it reached
exactly one terminal state; its event stream starts with `response.created`, is numbered 0..n
without gaps or duplicates, holds exactly one terminal event, last; that event's Response agrees
with what Postgres has (a cancel ends with `response.failed` carrying `status: cancelled`,
PROTOCOL.md §4.1); and a replay from any offset is the tail of the whole stream. Also `Workers`:
respool worker processes of a test's own, which a test may kill, freeze or stop.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import Any

import openai
from redis import Redis

from tests.support.stack import Stack, wait_for
from worker.keys import lease_key
from worker.translation.output import output_items
from worker.translation.replay import rebuild

TERMINAL = {"response.completed", "response.failed", "response.incomplete"}
TERMINAL_STATUSES = {"completed", "failed", "incomplete", "cancelled"}


def _wire(events: Iterable[Any]) -> list[dict[str, Any]]:
    return [event.model_dump(mode="json", exclude_unset=True) for event in events]


def check_ended(sdk: openai.OpenAI, response_id: str, offsets: Iterable[int] = (0, 2)) -> dict[str, Any]:
    """Assert the invariants of a response that has ended; return its stored Response."""
    stored = sdk.responses.retrieve(response_id).model_dump(mode="json", exclude_unset=True)
    assert stored["status"] in TERMINAL_STATUSES, f"{response_id} is still {stored['status']}"
    events = _wire(sdk.responses.retrieve(response_id, stream=True))
    numbers = [event["sequence_number"] for event in events]
    assert numbers == list(range(len(events))), f"{response_id}: sequence numbers {numbers}"
    assert events[0]["type"] == "response.created", f"{response_id} starts with {events[0]['type']}"
    terminals = [event for event in events if event["type"] in TERMINAL]
    assert terminals == [events[-1]], f"{response_id}: terminal events {[e['type'] for e in terminals]}"
    final = events[-1]["response"]
    assert (final["status"], final.get("error"), final["output"]) == (
        stored["status"],
        stored.get("error"),
        stored["output"],
    ), f"{response_id}: the stream's end and Postgres disagree"
    if stored["status"] == "completed":  # what its events tell adds up to it (DESIGN.md §4)
        told = output_items(rebuild(events))
        assert told == stored["output"], f"{response_id}: its events do not add up to its output"
    for offset in offsets:
        if offset < len(events):
            replay = _wire(sdk.responses.retrieve(response_id, stream=True, starting_after=offset))
            assert replay == events[offset + 1 :], f"{response_id}: replay after {offset} differs"
    return stored


def wait_until_ended(sdk: openai.OpenAI, response_ids: list[str], timeout: float) -> dict[str, str]:
    """Wait until every response has a terminal status; return their statuses."""
    statuses: dict[str, str] = {}

    def all_ended() -> bool:
        for response_id in response_ids:
            if statuses.get(response_id) not in TERMINAL_STATUSES:
                statuses[response_id] = sdk.responses.retrieve(response_id).status or ""
        return all(status in TERMINAL_STATUSES for status in statuses.values())

    wait_for(all_ended, timeout=timeout, interval=0.2, what="every response to end")
    return statuses


def lease_holders(redis: Redis, response_ids: list[str]) -> dict[str, str | None]:
    """Who holds each response's lease now (`"<attempt>:<holder>"`), or None."""
    values = redis.mget([lease_key(response_id) for response_id in response_ids])
    return {
        response_id: None if value is None else value.decode().partition(":")[2]
        for response_id, value in zip(response_ids, values, strict=True)
    }


def worker_name(redis: Redis, stack: Stack, process: str) -> str:
    """The RQ worker name (its lease holder name) of one of `stack`'s worker processes."""
    from rq import Worker

    pid = stack.processes[process].pid

    def find() -> str | None:
        return next((w.name for w in Worker.all(connection=redis) if w.pid == pid), None)

    return wait_for(find, timeout=30, what=f"{process} to register with RQ")


def signal_process(stack: Stack, process: str, sig: int) -> None:
    os.kill(stack.processes[process].pid, sig)


KILL, STOP, CONT = signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT
