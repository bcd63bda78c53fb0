"""Upstream faults through real processes (issue 4): what is retried, what fails, and what clients see.

A stack of its own (API and worker) retries fast (`RESPOOL_UPSTREAM_BACKOFF_SECONDS=0.01`) and calls
an upstream silent for 1 s stalled, so faults resolve quickly; nothing here asserts how fast.
Whatever the fault, the client sees one well-formed stream: numbered without gaps, one terminal
event whose Response is the stored one, and the same tail when replayed from an offset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.conftest import KEY_A, make_sdk, own_stack
from tests.support.stack import Servers, Stack
from tests.support.upstream_frames import Json
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.faults]

RETRIES = 3
TERMINAL_TYPES = {"response.completed", "response.failed", "response.incomplete"}
ANSWER = "back on its feet"


@pytest.fixture(scope="module")
def faults_client(
    stack: Stack, backing: Servers, upstream: ScriptedUpstream, session_dir: Path
) -> Iterator[openai.OpenAI]:
    """The SDK on an API and worker of their own, whose upstream retries fast and stalls after 1 s.

    Depends on `stack`, which migrated the shared database.
    """
    running = own_stack(
        backing,
        session_dir,
        "upstream-faults",
        RESPOOL_API_KEYS=f"{KEY_A}:tenant-a",
        RESPOOL_UPSTREAM_URL=upstream.url,
        RESPOOL_UPSTREAM_API="chat",
        RESPOOL_UPSTREAM_RETRIES=str(RETRIES),
        RESPOOL_UPSTREAM_BACKOFF_SECONDS="0.01",
        RESPOOL_UPSTREAM_BACKOFF_MAX_SECONDS="0.05",
        RESPOOL_UPSTREAM_STALL_SECONDS="1",
    )
    try:
        url = running.start_api("api-upstream-faults")
        running.start_worker("worker-upstream-faults")
        with make_sdk(url, KEY_A) as client:
            yield client
    finally:
        running.stop_all()


def recovers_after(fault: Json, times: int) -> Json:
    """A script that fails `times` requests with `fault`, then answers."""
    return {**fault, "times": times, "then": {"text": ANSWER}}


def server_error(status: int, message: str, **extra: Any) -> Json:
    return {"status": status, "error": {"message": message, "type": "server_error"}, **extra}


@dataclass(frozen=True)
class Case:
    """A misbehaving upstream, and what the client and the upstream should see of it."""

    script: Json
    status: str
    requests: int
    says: tuple[str, ...] = ()
    code: str = "server_error"


CASES = {
    "reset once, then answers": Case(recovers_after({"reset": True}, 1), "completed", 2),
    "429 with retry-after once, then answers": Case(
        recovers_after(server_error(429, "slow down", headers={"retry-after": "1"}), 1), "completed", 2
    ),
    "500 twice, then answers": Case(recovers_after(server_error(500, "oops"), 2), "completed", 3),
    "500 always": Case(
        server_error(500, "still broken"),
        "failed",
        RETRIES + 1,
        ("500", "still broken", f"gave up after {RETRIES + 1} attempts"),
    ),
    "400": Case(
        {"status": 400, "error": {"message": "context too long", "type": "invalid_request_error"}},
        "failed",
        1,
        ("400", "context too long"),
    ),
    "404 model not found": Case(
        {"status": 404, "error": {"message": "The model `x` does not exist.", "code": "model_not_found"}},
        "failed",
        1,
        ("404", "does not exist"),
        "model_not_found",
    ),
    "401 for our key": Case(
        {"status": 401, "error": {"message": "Incorrect API key provided."}},
        "failed",
        1,
        ("401", "Incorrect API key"),
        "upstream_unauthorized",
    ),
    "403 for our key": Case(
        {"status": 403, "error": {"message": "Forbidden."}}, "failed", 1, ("403",), "upstream_forbidden"
    ),
    # llama-cpp-python answers 200 with an empty stream when it fails inside: nothing reached a
    # client, so it is retried like a lost connection.
    "an empty stream once, then answers": Case(
        recovers_after({"chunks": [], "done": False}, 1), "completed", 2
    ),
    "an empty stream always": Case(
        {"chunks": [], "done": False},
        "failed",
        RETRIES + 1,
        ("ended its stream without a finish_reason", f"gave up after {RETRIES + 1} attempts"),
    ),
    "[DONE] with no finish_reason after output": Case(
        {"chunks": [{"delta": {"role": "assistant", "content": "half an"}}]},
        "failed",
        1,
        ("sent [DONE] without a finish_reason",),
    ),
    # A stall before any output is retried like a lost connection: nothing reached a client yet.
    "stalls after its headers": Case(
        {"hang": True},
        "failed",
        RETRIES + 1,
        ("sent nothing for 1 s", f"gave up after {RETRIES + 1} attempts"),
    ),
}


def wire(events: list[ResponseStreamEvent]) -> list[dict[str, Any]]:
    return [event.model_dump(mode="json", exclude_unset=True) for event in events]


def terminal_response(client: openai.OpenAI, events: list[ResponseStreamEvent]) -> Response:
    """The one terminal event's Response, once the stream has been checked whole and against storage."""
    terminals = [event for event in events if event.type in TERMINAL_TYPES]
    assert len(terminals) == 1
    assert terminals[0] is events[-1]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final: Response = terminals[0].response  # type: ignore[union-attr]
    stored = client.responses.retrieve(final.id)
    assert (stored.status, stored.error, stored.output) == (final.status, final.error, final.output)
    return final


def assert_replays_are_tails(client: openai.OpenAI, events: list[ResponseStreamEvent]) -> None:
    """Replaying after a few offsets gives exactly the live stream's events after each."""
    response_id = terminal_response(client, events).id
    live = wire(events)
    for offset in sorted({0, len(events) // 2, len(events) - 2}):
        replay = list(client.responses.retrieve(response_id, stream=True, starting_after=offset))
        assert wire(replay) == live[offset + 1 :]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_an_upstream_fault_ends_in_one_well_formed_stream(
    faults_client: openai.OpenAI, upstream: ScriptedUpstream, model: str, case: Case
) -> None:
    """Transient faults before output are retried to success or to a failure naming the cause and attempts;
    refusals and faults after output fail at once; every stream is gapless with one terminal event."""
    upstream.script(model, case.script)

    events = list(faults_client.responses.create(model=model, input="x", background=True, stream=True))

    final = terminal_response(faults_client, events)
    assert final.status == case.status
    assert len(upstream.requests(model)) == case.requests
    if case.status == "completed":
        assert final.error is None
        assert final.output_text == ANSWER
    else:
        assert final.error is not None
        assert final.error.message.startswith("The upstream model failed: ")
        assert final.error.code == case.code
        assert final.error.type == (
            "invalid_request_error" if case.code == "model_not_found" else "server_error"
        )
        for words in case.says:
            assert words in final.error.message
        if case.requests == 1:
            assert "gave up" not in final.error.message
    assert_replays_are_tails(faults_client, events)


def test_a_cut_after_output_keeps_what_was_streamed(
    faults_client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A connection cut mid-answer is not retried: the failed Response holds the words streamed, incomplete."""
    upstream.script(model, {"text": "one two three four five", "drop_after": 3})

    events = list(faults_client.responses.create(model=model, input="x", background=True, stream=True))

    final = terminal_response(faults_client, events)
    assert final.status == "failed"
    assert final.error is not None and "cut its answer short" in final.error.message
    assert "gave up" not in final.error.message
    assert [(item.status, item.content[0].text) for item in final.output] == [("incomplete", "one two ")]  # type: ignore[union-attr]
    assert len(upstream.requests(model)) == 1
    assert_replays_are_tails(faults_client, events)
