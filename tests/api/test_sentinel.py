"""Redis behind Sentinel: respool finds the primary through the sentinels, and a forced failover
(`SENTINEL FAILOVER`) under load loses nothing: every response completes, once, its stream gapless.

The set is one primary, one replica and three sentinels on loopback (tests/support/sentinel.py);
respool is given only the sentinels (`RESPOOL_REDIS_SENTINELS`, `RESPOOL_REDIS_SENTINEL_MASTER`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from redis import Redis

from tests.conftest import KEY_A, _env, make_sdk
from tests.support.sentinel import MASTER, SentinelSet, sentinel_set
from tests.support.stack import (
    ROOT,
    Servers,
    Stack,
    _healthy,
    free_port,
    fresh_database,
    rows_with_metadata,
    running_stack,
    wait_for,
)
from worker.keys import events_key

pytestmark = [pytest.mark.integration, pytest.mark.faults]

FOLLOWED = 20  # background responses whose event streams the SDK reads as they are written
POLLED = 20  # background responses their clients poll
WORDS = 150  # at 0.05 s a word, each response runs past the failover
STREAM_TIMEOUT = 90.0  # a stream left hanging by the failover fails the test, in bounded time
SETTLE_SECONDS = 120.0
TERMINAL_EVENTS = {"response.completed", "response.failed", "response.incomplete"}


@pytest.fixture(scope="module")
def sentinels() -> Iterator[SentinelSet]:
    with sentinel_set() as running:
        yield running


@pytest.fixture(scope="module")
def database(backing: Servers) -> Iterator[str]:
    with fresh_database(backing.database_url) as url:
        yield url


@pytest.fixture(scope="module")
def sentinel_stack(
    sentinels: SentinelSet, database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """An API and a worker that know only the sentinels (no RESPOOL_REDIS_URL)."""
    env = _env(
        Servers("", database),
        RESPOOL_REDIS_SENTINELS=sentinels.sentinels,
        RESPOOL_REDIS_SENTINEL_MASTER=MASTER,
        RESPOOL_API_KEYS=f"{KEY_A}:tenant-a",
        RESPOOL_SYNTHETIC_DELAY_SECONDS="0.05",
        RESPOOL_REDIS_TIMEOUT_SECONDS="2",
        RESPOOL_SSE_HEARTBEAT_SECONDS="2",
    )
    del env["RESPOOL_REDIS_URL"]
    with running_stack(env, tmp_path_factory.mktemp("sentinel-logs"), migrate=False) as stack:
        yield stack


@pytest.fixture(scope="module")
def sdk(sentinel_stack: Stack) -> Iterator[openai.OpenAI]:
    with make_sdk(sentinel_stack.url, KEY_A).with_options(timeout=STREAM_TIMEOUT) as client:
        yield client


def words(count: int) -> str:
    return " ".join(f"w{n}" for n in range(count))


def follow(sdk: openai.OpenAI, marker: str, index: int, seen: threading.Event) -> list[ResponseStreamEvent]:
    """A background response created with `stream=True`, every event of it as the SDK reads it."""
    events = []
    stream = sdk.responses.create(
        model="synthetic",
        input=words(WORDS + index),
        background=True,
        stream=True,
        metadata={"m": marker},
    )
    for event in stream:
        events.append(event)
        if len(events) >= 5:
            seen.set()
    return events


def settled(sdk: openai.OpenAI, response_id: str) -> Response:
    """The response once terminal, polled as a client polls (a 503 meanwhile is waited out)."""

    def check() -> Response | None:
        try:
            response = sdk.responses.retrieve(response_id)
        except openai.InternalServerError:
            return None
        return None if response.status in ("queued", "in_progress") else response

    return wait_for(check, timeout=SETTLE_SECONDS, interval=0.5, what=f"{response_id} to end")


def assert_gapless_and_ended_once(events: list[ResponseStreamEvent]) -> None:
    assert [event.sequence_number for event in events] == list(range(len(events)))
    terminal = [event for event in events if event.type in TERMINAL_EVENTS]
    assert len(terminal) == 1 and terminal[0] is events[-1], [event.type for event in events[-3:]]


def test_the_primary_is_found_through_the_sentinels(sdk: openai.OpenAI) -> None:
    """With only the sentinels configured, a response is created, run and streamed."""
    events = list(sdk.responses.create(model="synthetic", input="hello there", stream=True))
    assert events[-1].type == "response.completed"


@dataclass
class Failover:
    """What the load saw across a forced failover: the polled ids and each followed stream."""

    marker: str
    polled: list[str]
    streams: list[list[ResponseStreamEvent]]
    kept: dict[str, list[tuple[bytes, bytes]]]  # each response's stream as the set kept it: (id, type)


@pytest.fixture(scope="module")
def failover(sentinels: SentinelSet, sdk: openai.OpenAI) -> Failover:
    """20 followed and 20 polled responses, a failover forced while all of them run, then the old
    primary demoted and synced (what it alone took after the promotion is gone from the set then)."""
    marker = uuid.uuid4().hex
    before = sentinels.primary()
    with ThreadPoolExecutor(FOLLOWED) as pool:
        seen = [threading.Event() for _ in range(FOLLOWED)]
        readers: list[Future[list[ResponseStreamEvent]]] = [
            pool.submit(follow, sdk, marker, index, seen[index]) for index in range(FOLLOWED)
        ]
        polled = [
            sdk.responses.create(
                model="synthetic", input=words(WORDS + index), background=True, metadata={"m": marker}
            ).id
            for index in range(POLLED)
        ]
        for event in seen:
            assert event.wait(60), "a followed response streamed nothing before the failover"
        wait_for(
            lambda: all(sdk.responses.retrieve(rid).status == "in_progress" for rid in polled),
            timeout=60,
            what="the polled responses to start",
        )
        assert sentinels.fail_over() != before
        streams = [reader.result(timeout=SETTLE_SECONDS) for reader in readers]
    followed = [events[0].response.id for events in streams]  # type: ignore[union-attr]
    for response_id in [*polled, *followed]:
        settled(sdk, response_id)
    sentinels.wait_demoted(before)
    host, port = sentinels.primary()
    with Redis(host=host, port=port, socket_timeout=5) as primary:
        kept = {
            response_id: [(entry, fields[b"t"]) for entry, fields in primary.xrange(events_key(response_id))]
            for response_id in [*polled, *followed]
        }
    return Failover(marker, polled, streams, kept)


def test_a_failover_under_load_loses_nothing(failover: Failover, sdk: openai.OpenAI, database: str) -> None:
    """Every response of the load completes, once: exactly 40 rows, each replayed stream gapless
    with one terminal event and the stored output as its text."""
    assert rows_with_metadata(Servers("", database), failover.marker) == FOLLOWED + POLLED
    # As Redis kept them, before any replay (a replay of a stream left without its end rebuilds it
    # from Postgres, which would hide what was lost): every event, in order, the terminal one last.
    for response_id, entries in failover.kept.items():
        assert [entry for entry, _ in entries] == [f"0-{n}".encode() for n in range(1, len(entries) + 1)]
        assert entries and entries[-1][1] == b"response.completed", (response_id, entries[-3:])
    followed = [events[0].response.id for events in failover.streams]  # type: ignore[union-attr]
    for response_id in [*failover.polled, *followed]:
        response = settled(sdk, response_id)
        assert response.status == "completed", (response_id, response.error)
        replay = list(sdk.responses.retrieve(response_id, stream=True))
        assert_gapless_and_ended_once(replay)
        text = "".join(event.delta for event in replay if event.type == "response.output_text.delta")
        assert text == response.output_text


def test_followed_streams_stay_open_across_a_failover(failover: Failover) -> None:
    """Each followed stream, read live by the SDK, runs through the failover to its completion."""
    cut = [
        (events[0].response.id, len(events))  # type: ignore[union-attr]
        for events in failover.streams
        if events[-1].type == "error"
    ]
    assert not cut, f"{len(cut)} of {FOLLOWED} live streams ended with an error event: {cut}"
    for events in failover.streams:
        assert_gapless_and_ended_once(events)
        assert events[-1].response.status == "completed"  # type: ignore[union-attr]


def test_respool_up_with_sentinels_embeds_no_redis(
    sentinels: SentinelSet, database: str, tmp_path: Path
) -> None:
    """`respool up` given the sentinels (and a Postgres) starts no Redis of its own and serves on the
    sentinels' primary; Ctrl-C stops it."""
    port = free_port()
    env = _env(
        Servers("", database),
        RESPOOL_REDIS_SENTINELS=sentinels.sentinels,
        RESPOOL_REDIS_SENTINEL_MASTER=MASTER,
        RESPOOL_DATA_DIR=str(tmp_path),
    )
    del env["RESPOOL_REDIS_URL"]
    argv = [sys.executable, "-m", "api", "up", "--port", str(port), "--workers", "1"]
    with (tmp_path / "console").open("ab") as console:
        process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url, process), timeout=90, what="respool up to listen")
        with make_sdk(url, "unused") as client:
            response = client.responses.create(model="synthetic", input="through the sentinels")
        assert response.status == "completed"
        assert not (tmp_path / "redis").exists()  # no embedded Redis
        host, primary_port = sentinels.primary()
        with Redis(host=host, port=primary_port, socket_timeout=5) as primary:
            assert primary.exists(events_key(response.id))
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
