"""respool behind PgBouncer in `pool_mode = transaction` (docs/postgres.md), with a pool of 5 server
connections shared by every client transaction: the migrations, and every feature under
concurrency (background creates and their polls, streams, chains, conversations, cancel, delete),
each request answered as without a pooler, never a 500.

Under transaction pooling a statement prepared in one transaction is not there in the next (another
server connection runs it), nor is any other session state: this module fails at once if respool
prepares a statement or keeps session state.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from openai.types.responses import Response

from tests.conftest import _env, make_sdk
from tests.support.pgbouncer import PgBouncer
from tests.support.stack import ROOT, Servers, Stack, fresh_database, running_stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

CLIENT_TIMEOUT = 30.0
TERMINAL = {"completed", "failed", "incomplete", "cancelled"}
TERMINAL_EVENTS = {"response.completed", "response.failed", "response.incomplete"}


@pytest.fixture(scope="module")
def bouncer(backing: Servers) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of a database of this module's own, unmigrated."""
    with fresh_database(backing.database_url, migrated=False) as database:
        running = PgBouncer.start(database, pool_mode="transaction", pool_size=5)
        yield running
        running.stop()


@pytest.fixture(scope="module")
def pooled(backing: Servers, bouncer: PgBouncer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The schema migrated through PgBouncer, and an API and a worker on it."""
    env = _env(
        backing,
        RESPOOL_DATABASE_URL=bouncer.url,
        RESPOOL_DATABASE_POOLER="transaction",
        RESPOOL_SYNTHETIC_DELAY_SECONDS="0.005",
    )
    with running_stack(env, tmp_path_factory.mktemp("pooler-logs")) as stack:
        yield stack


@pytest.fixture(scope="module")
def sdk(pooled: Stack) -> Iterator[openai.OpenAI]:
    with make_sdk(pooled.url, "any").with_options(timeout=CLIENT_TIMEOUT) as client:
        yield client


def at_once[T](calls: list[Callable[[], T]]) -> list[T]:
    """Every call in a thread of its own, all started together; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def settled(sdk: openai.OpenAI, response_id: str) -> Response:
    def check() -> Response | None:
        response = sdk.responses.retrieve(response_id)
        return response if response.status in TERMINAL else None

    return wait_for(check, timeout=60, interval=0.05, what=f"{response_id} to end")


def quoted(text: str) -> str:
    return f'This is respool\'s synthetic model. You said: "{text}"'


def assert_whole(events: list[Any]) -> None:
    """A stream that is gapless and ends with its one terminal event, `response.completed`."""
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events if event.type in TERMINAL_EVENTS] == ["response.completed"]
    assert events[-1].type == "response.completed"


def test_migrations_run_through_the_pooler_concurrently(pooled: Stack) -> None:
    """Two `respool migrate` at once through PgBouncer both succeed (the migration's lock is its
    transaction's, not a session's)."""
    runs = [
        subprocess.Popen([sys.executable, "-m", "api", "migrate"], env=pooled.env, cwd=ROOT) for _ in range(2)
    ]
    assert [run.wait(120) for run in runs] == [0, 0]


def test_fifty_concurrent_background_creates_all_complete(sdk: openai.OpenAI) -> None:
    """50 background creates at once are each accepted, then polled to `completed` with their text."""
    created = at_once(
        [
            lambda n=n: sdk.responses.create(model="synthetic", input=f"bg {n}", background=True)
            for n in range(50)
        ]
    )
    assert {response.status for response in created} <= {"queued", "in_progress"}
    ended = at_once([lambda rid=response.id: settled(sdk, rid) for response in created])
    assert [(r.status, r.output_text) for r in ended] == [("completed", quoted(f"bg {n}")) for n in range(50)]


def test_twenty_concurrent_streams_are_whole(sdk: openai.OpenAI) -> None:
    """20 streams at once each arrive gapless with their one `response.completed`, and replay the same."""
    streams = at_once(
        [
            lambda n=n: list(sdk.responses.create(model="synthetic", input=f"stream {n}", stream=True))
            for n in range(20)
        ]
    )
    for n, events in enumerate(streams):
        assert_whole(events)
        assert events[-1].response.output_text == quoted(f"stream {n}")
    replays = at_once(
        [
            lambda rid=events[0].response.id: list(sdk.responses.retrieve(rid, stream=True))
            for events in streams
        ]
    )
    for events, replay in zip(streams, replays, strict=True):
        assert [event.type for event in replay] == [event.type for event in events]


def test_chains_and_conversations_run_concurrently(sdk: openai.OpenAI) -> None:
    """Ten chains (previous_response_id) and ten conversations, three turns each, side by side:
    each turn answers, and each conversation holds its six items in order."""

    def chain(n: int) -> list[str]:
        previous: str | None = None
        said = []
        for turn in range(3):
            response = sdk.responses.create(
                model="synthetic", input=f"chain {n} turn {turn}", previous_response_id=previous
            )
            previous, _ = response.id, said.append(response.output_text)
        return said

    def conversation(n: int) -> list[str]:
        conversation_id = sdk.conversations.create().id
        for turn in range(3):
            sdk.responses.create(
                model="synthetic", input=f"conv {n} turn {turn}", conversation=conversation_id
            )
        items = sdk.conversations.items.list(conversation_id, order="asc")
        return [item.content[0].text for item in items.data]  # type: ignore[union-attr]

    chains = at_once([lambda n=n: chain(n) for n in range(10)])
    conversations = at_once([lambda n=n: conversation(n) for n in range(10)])
    for n, said in enumerate(chains):
        assert said == [quoted(f"chain {n} turn {turn}") for turn in range(3)]
    for n, items in enumerate(conversations):
        expected = [
            text for turn in range(3) for text in (f"conv {n} turn {turn}", quoted(f"conv {n} turn {turn}"))
        ]
        assert items == expected


def test_cancel_and_delete_run_concurrently(sdk: openai.OpenAI) -> None:
    """Ten running background responses cancelled at once end `cancelled`; ten finished ones deleted
    at once are gone."""
    long_input = " ".join(f"w{n}" for n in range(2000))
    running = at_once(
        [
            lambda: sdk.responses.create(model="synthetic", input=long_input, background=True)
            for _ in range(10)
        ]
    )
    cancelled = at_once([lambda rid=response.id: sdk.responses.cancel(rid) for response in running])
    assert {response.status for response in cancelled} == {"cancelled"}
    assert {settled(sdk, response.id).status for response in running} == {"cancelled"}
    finished = at_once(
        [lambda n=n: sdk.responses.create(model="synthetic", input=f"d{n}") for n in range(10)]
    )
    at_once([lambda rid=response.id: sdk.responses.delete(rid) for response in finished])
    for response in finished:
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response.id)


@pytest.fixture(scope="module")
def unaware(
    backing: Servers, bouncer: PgBouncer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """An API on the same PgBouncer that is not told of it (RESPOOL_DATABASE_POOLER left `none`):
    it prepares its hot statements, which the pooler loses between server connections."""
    env = _env(backing, RESPOOL_DATABASE_URL=bouncer.url, RESPOOL_DATABASE_POOLER="none")
    stack = Stack(env, tmp_path_factory.mktemp("unaware-logs"))
    stack.start_api()
    yield stack
    stack.stop_all()


def status_of(call: Callable[[], object]) -> tuple[int, str | None]:
    """The HTTP status `call` was answered with, and its `retry-after`."""
    try:
        call()
    except openai.APIStatusError as error:
        return error.status_code, error.response.headers.get("retry-after")
    return 200, None


def test_a_pooler_left_unsaid_is_a_503_never_a_500(unaware: Stack) -> None:
    """Behind a transaction pooler the settings do not name, what the pooler breaks (a prepared
    statement missing, or there already) is answered 503 with `retry-after`, never 500."""
    with make_sdk(unaware.url, "any").with_options(timeout=CLIENT_TIMEOUT) as client:
        answers = at_once(
            [
                lambda n=n: status_of(
                    lambda: client.responses.create(model="synthetic", input=f"u{n}", background=True)
                )
                for n in range(50)
            ]
        )
    statuses = {status for status, _ in answers}
    assert statuses <= {200, 503}, answers
    assert 503 in statuses  # the pooler did break some: else this shows nothing
    assert all(retry_after is not None for status, retry_after in answers if status == 503)


def test_no_request_was_answered_500(pooled: Stack) -> None:
    """Nothing the module sent through the pooler met a server error: the API logged none."""
    assert " 500 " not in pooled.log("api") and "Traceback" not in pooled.log("api")
    assert "Traceback" not in pooled.log("worker")
