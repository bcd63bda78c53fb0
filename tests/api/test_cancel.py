"""Cancels from any API process, storms of them, races with completion, and clients that go away (DESIGN.md §2.5)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.conftest import KEY_A
from tests.support.faults import check_ended, wait_until_ended
from tests.support.stack import Servers, Stack, wait_for
from tests.support.upstream_process import ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.faults]

SLOW = {"text": " ".join(f"w{n}" for n in range(150)), "delay": 0.4}  # a minute: cancels come first


def _cancel(sdk: openai.OpenAI, response_id: str) -> str:
    """The status a cancel answered with, or the 400's message."""
    try:
        return sdk.responses.cancel(response_id).status or ""
    except openai.BadRequestError as error:
        return str(error.message)


def test_a_cancel_storm_through_two_api_processes(
    client: openai.OpenAI, second_api: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """40 live responses, each cancelled twice at once through both API processes: each ends cancelled
    exactly once, every cancel answers the cancelled Response, and every upstream stream is closed."""
    upstream.script(model, SLOW)
    created = [client.responses.create(model=model, input="x", background=True).id for _ in range(40)]
    upstream.stats(until_active=20, timeout=30)  # some run, some may still be queued
    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(_cancel, [client, second_api] * 40, [rid for rid in created for _ in (0, 1)]))
    assert set(answers) == {"cancelled"}
    assert upstream.stats(until_active=0, timeout=30)["active"] == 0
    print(
        f"cancel storm: every upstream stream closed {time.monotonic() - started:.2f} s after the first cancel"
    )
    for response_id in created:
        stored = check_ended(client, response_id)
        assert stored["status"] == "cancelled"
        assert second_api.responses.cancel(response_id).status == "cancelled"  # idempotent (PROTOCOL.md §7)


def test_cancel_racing_completion_has_one_outcome(
    client: openai.OpenAI, second_api: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Cancels that race with completion: a 200 means the response ends cancelled, a 400 that it completed."""
    upstream.script(model, {"text": "a b c d e", "delay": 0.02})
    created = [client.responses.create(model=model, input="x", background=True).id for _ in range(30)]
    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(created, pool.map(_cancel, [second_api] * 30, created), strict=True))
    statuses = wait_until_ended(client, created, timeout=60)
    for response_id, answer in answers.items():
        expected = "cancelled" if answer == "cancelled" else "completed"
        assert statuses[response_id] == expected, (answer, statuses[response_id])
        assert check_ended(client, response_id)["status"] == expected


def test_a_foreground_stream_whose_client_leaves_is_cancelled(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Dropping a foreground stream cancels the response and closes its upstream request."""
    upstream.script(model, SLOW)
    stream = client.responses.create(model=model, input="x", stream=True)
    events = [next(stream) for _ in range(5)]
    stream.close()
    response_id = events[0].response.id  # type: ignore[union-attr]
    wait_for(
        lambda: client.responses.retrieve(response_id).status == "cancelled", timeout=30, what="the cancel"
    )
    assert upstream.stats(until_active=0, timeout=30)["active"] == 0
    check_ended(client, response_id)


def test_a_foreground_request_whose_client_leaves_is_cancelled(
    stack: Stack, backing: Servers, client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A foreground (non-streaming) request abandoned by its client is cancelled, not left running."""
    upstream.script(model, SLOW)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{stack.url}/v1/responses",
            json={"model": model, "input": "x"},
            headers={"authorization": f"Bearer {KEY_A}"},
            timeout=httpx.Timeout(10, read=1.5),
        )
    assert upstream.stats(until_active=0, timeout=30)["active"] == 0
    (response_id,) = _ids_of(backing, model)  # the client never learnt it
    wait_for(
        lambda: client.responses.retrieve(response_id).status == "cancelled", timeout=30, what="the cancel"
    )
    check_ended(client, response_id)
    assert len(upstream.requests(model)) == 1


def _ids_of(backing: Servers, model: str) -> list[str]:
    engine = create_engine(backing.database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(
                conn.execute(text("SELECT id FROM response WHERE model = :m"), {"m": model}).scalars()
            )
    finally:
        engine.dispose()


def test_a_background_stream_whose_client_leaves_runs_on(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Dropping the stream of a background response never touches it: it completes."""
    upstream.script(model, {"text": "a b c d e f g h", "delay": 0.1})
    stream = client.responses.create(model=model, input="x", stream=True, background=True)
    first = next(stream)
    stream.close()
    response_id = first.response.id  # type: ignore[union-attr]
    assert wait_until_ended(client, [response_id], timeout=30) == {response_id: "completed"}
    check_ended(client, response_id)
