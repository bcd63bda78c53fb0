"""Infrastructure faults (issue 4): Redis or Postgres going down, coming back, or coming back empty.

Each class takes a server of its own down while responses are finished, live and mid-stream,
checks what every route answers meanwhile (a 503 with `retry-after` within the client's timeout,
or the stored answer where Postgres alone serves it), then brings the server back and checks that
nothing committed was lost, new work flows, and every response reached exactly one terminal state,
the same in Postgres as at the end of its gapless event stream.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import openai
import orjson
import pytest
import sqlalchemy as sa
from openai.types.responses import Response, ResponseStreamEvent
from redis import Redis
from sqlalchemy.pool import NullPool

from tests.conftest import KEY_A, _env, make_sdk
from tests.support.outages import Restartable
from tests.support.queue import QueueView
from tests.support.stack import Stack, running_stack, wait_for
from worker.keys import events_key, lease_key, queue_key
from worker.postgres.store import async_url

pytestmark = [pytest.mark.integration, pytest.mark.faults]

CLIENT_TIMEOUT = 10.0  # a hang shows up as openai.APITimeoutError
STREAM_TIMEOUT = 60.0  # for the readers left open across an outage: a hang outlives every deadline below
RETRY_AFTER = "3"
SETTLE_SECONDS = 120.0  # recovery waits on leases, RQ's maintenance and the sweep: generous
LIVE = {"queued", "in_progress"}
TERMINAL_EVENTS = {"response.completed", "response.failed", "response.incomplete"}


@pytest.fixture(scope="module")
def faulty(servers: Restartable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An API and a worker on `servers`; the synthetic model writes a word every 0.1 s."""
    env = _env(
        servers,  # type: ignore[arg-type]  # has the two URLs Servers has
        RESPOOL_API_KEYS=f"{KEY_A}:tenant-a",
        RESPOOL_SYNTHETIC_DELAY_SECONDS="0.1",
        RESPOOL_REDIS_TIMEOUT_SECONDS="2",
        RESPOOL_RETRY_AFTER_SECONDS=RETRY_AFTER,
    )
    with running_stack(env, tmp_path_factory.mktemp("outage-logs")) as stack:
        yield stack


@pytest.fixture(scope="module")
def sdk(faulty: Stack) -> Iterator[openai.OpenAI]:
    """The SDK as tenant A, giving up on any answer after CLIENT_TIMEOUT."""
    with make_sdk(faulty.url, KEY_A).with_options(timeout=CLIENT_TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def patient_sdk(faulty: Stack) -> Iterator[openai.OpenAI]:
    """The SDK for requests left open across an outage."""
    with make_sdk(faulty.url, KEY_A).with_options(timeout=STREAM_TIMEOUT) as client:
        yield client


def words(count: int) -> str:
    return " ".join(f"w{n}" for n in range(count))


@dataclass
class Scene:
    """The responses an outage finds: finished ones, a running one to cancel, some mid-stream."""

    done: Response
    done_events: list[ResponseStreamEvent]
    spare: str  # finished: what the outage's delete aims at
    live: str  # background and running: what the outage's cancel aims at
    in_flight: list[str]
    readers: dict[str, Future[list[ResponseStreamEvent]]] = field(default_factory=dict)
    foreground: Future[Response] | None = None
    foreground_id: str = ""
    raw: Future[list[tuple[float, int | None]]] | None = None  # `read_raw_stream`'s
    stopped_at: float = 0.0  # when the outage began (time.monotonic)


def stage(sdk: openai.OpenAI, lengths: tuple[int, ...] = (10, 60, 200)) -> Scene:
    """Finished, running and mid-stream responses (of `lengths` words), for an outage to find."""
    done = sdk.responses.create(model="synthetic", input="finished before the outage")
    spare = sdk.responses.create(model="synthetic", input="spare")
    live = sdk.responses.create(model="synthetic", input=words(300), background=True)
    # Of different lengths, so some end while the server is down and some after it is back.
    in_flight = [sdk.responses.create(model="synthetic", input=words(n), background=True).id for n in lengths]
    running = [live.id, *in_flight]
    wait_for(
        lambda: all(sdk.responses.retrieve(rid).status == "in_progress" for rid in running),
        what="the staged responses to start",
    )
    done_events = list(sdk.responses.retrieve(done.id, stream=True))
    return Scene(done, done_events, spare.id, live.id, in_flight)


def settled(sdk: openai.OpenAI, response_id: str) -> Response:
    """The response once it is terminal (503s while the servers recover are waited out)."""

    def check() -> Response | None:
        try:
            response = sdk.responses.retrieve(response_id)
        except openai.InternalServerError:
            return None
        return None if response.status in LIVE else response

    return wait_for(check, timeout=SETTLE_SECONDS, interval=0.5, what=f"{response_id} to end")


def assert_one_end(sdk: openai.OpenAI, response_id: str) -> Response:
    """The response ended once: its replay is gapless and ends with the one terminal event, whose
    Response has the status Postgres has."""
    response = settled(sdk, response_id)
    events = list(sdk.responses.retrieve(response_id, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    terminal = [event for event in events if event.type in TERMINAL_EVENTS]
    assert len(terminal) == 1 and terminal[0] is events[-1], [event.type for event in events]
    assert terminal[0].response.status == response.status  # type: ignore[union-attr]
    return response


def assert_503(call: Callable[[], object]) -> openai.InternalServerError:
    """`call` answers 503 in OpenAI's envelope, with the configured `retry-after`, before the client gives up."""
    with pytest.raises(openai.InternalServerError) as caught:
        call()
    error = caught.value
    assert error.status_code == 503
    assert error.response.headers["retry-after"] == RETRY_AFTER
    assert (error.type, error.code) == ("server_error", "service_unavailable")
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param", "code"}
    return error


def assert_worker_alive(stack: Stack) -> None:
    assert stack.processes["worker"].poll() is None, stack.log("worker")[-3000:]


def row_count(servers: Restartable) -> int:
    engine = sa.create_engine(async_url(servers.database_url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM response")).scalar_one())
    finally:
        engine.dispose()


def last_event_type(servers: Restartable, response_id: str) -> str:
    """The type of the newest event on the response's stream, read from Redis itself."""
    with Redis.from_url(servers.redis_url) as redis:
        (_, fields), *_ = redis.xrevrange(events_key(response_id), count=1)
        return str(fields[b"t"].decode())


def probe(stack: Stack, path: str) -> int:
    return httpx.get(stack.url + path, timeout=CLIENT_TIMEOUT).status_code


ROUTES: dict[str, Callable[[openai.OpenAI, Scene], object]] = {
    "create": lambda sdk, s: sdk.responses.create(model="synthetic", input="x"),
    "create_stream": lambda sdk, s: list(sdk.responses.create(model="synthetic", input="x", stream=True)),
    "create_background": lambda sdk, s: sdk.responses.create(model="synthetic", input="x", background=True),
    "retrieve": lambda sdk, s: sdk.responses.retrieve(s.done.id),
    "retrieve_stream": lambda sdk, s: list(sdk.responses.retrieve(s.done.id, stream=True)),
    "cancel": lambda sdk, s: sdk.responses.cancel(s.live),
    "delete": lambda sdk, s: sdk.responses.delete(s.spare),
    "input_items": lambda sdk, s: sdk.responses.input_items.list(s.done.id),
}
CREATES = {"create", "create_stream", "create_background"}


def assert_recovered(stack: Stack, sdk: openai.OpenAI, scene: Scene) -> None:
    """What every outage must leave behind, once its server is back."""
    again = sdk.responses.retrieve(scene.done.id)
    assert (again.status, again.output_text) == ("completed", scene.done.output_text)
    cancelled = sdk.responses.cancel(scene.live)  # a cancel an outage cut short is completed by its retry
    assert cancelled.status == "cancelled"
    assert assert_one_end(sdk, scene.live).status == "cancelled"
    for response_id in scene.in_flight:
        assert_one_end(sdk, response_id)
    sdk.responses.delete(scene.spare)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(scene.spare)
    fresh = sdk.responses.create(model="synthetic", input="after the outage", background=True)
    assert settled(sdk, fresh.id).status == "completed"
    assert_worker_alive(stack)


class TestPostgresDown:
    """Postgres stopped: every route is a quick 503; once it is back, nothing committed is lost."""

    @pytest.fixture(scope="class")
    @classmethod
    def scene(cls, servers: Restartable, sdk: openai.OpenAI) -> Iterator[Scene]:
        scene = stage(sdk, lengths=(40, 60, 200))
        servers.stop_postgres()
        yield scene
        if servers.postgres is None:
            servers.start_postgres()

    @pytest.mark.parametrize("route", ROUTES)
    def test_routes_answer_503_quickly(self, sdk: openai.OpenAI, scene: Scene, route: str) -> None:
        """Each route answers 503 with retry-after while Postgres is down, well within the client's timeout."""
        error = assert_503(lambda: ROUTES[route](sdk, scene))
        assert error.response.headers.get("x-should-retry") != "false"  # nothing was recorded

    def test_alive_but_not_ready(self, faulty: Stack, scene: Scene) -> None:
        """/healthz stays 200 while Postgres is down; /readyz says 503."""
        assert (probe(faulty, "/healthz"), probe(faulty, "/readyz")) == (200, 503)

    def test_back_with_nothing_lost(
        self, servers: Restartable, faulty: Stack, sdk: openai.OpenAI, scene: Scene
    ) -> None:
        """Once Postgres is back, requests succeed, earlier responses are intact, and each in flight ended once."""
        finishing = scene.in_flight[0]  # generates its last words while Postgres is down
        wait_for(
            lambda: last_event_type(servers, finishing) == "response.output_item.done",
            what=f"{finishing} to finish generating",
        )
        servers.start_postgres()
        assert probe(faulty, "/readyz") == 200
        assert_recovered(faulty, sdk, scene)

    def test_a_response_that_finished_while_down_completes(self, sdk: openai.OpenAI, scene: Scene) -> None:
        """A response that finished generating while Postgres was down is recorded completed once it is back."""
        assert settled(sdk, scene.in_flight[0]).status == "completed"


class _StackOfItsOwn:
    """A class whose tests run on an API and a worker of its own (on the module's `servers`), with
    `ENV` over the module stack's settings and heartbeats every `HEARTBEAT_SECONDS`."""

    ENV: dict[str, str] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def faulty(cls, servers: Restartable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        env = _env(
            servers,  # type: ignore[arg-type]  # has the two URLs Servers has
            RESPOOL_API_KEYS=f"{KEY_A}:tenant-a",
            RESPOOL_SYNTHETIC_DELAY_SECONDS="0.1",
            RESPOOL_REDIS_TIMEOUT_SECONDS="2",
            RESPOOL_RETRY_AFTER_SECONDS=RETRY_AFTER,
            RESPOOL_SSE_HEARTBEAT_SECONDS=str(HEARTBEAT_SECONDS),
            **cls.ENV,
        )
        if servers.redis is None:
            servers.start_redis()
        with running_stack(env, tmp_path_factory.mktemp("outage-logs")) as stack:
            yield stack

    @pytest.fixture(scope="class")
    @classmethod
    def sdk(cls, faulty: Stack) -> Iterator[openai.OpenAI]:
        with make_sdk(faulty.url, KEY_A).with_options(timeout=CLIENT_TIMEOUT) as client:
            yield client

    @pytest.fixture(scope="class")
    @classmethod
    def patient_sdk(cls, faulty: Stack) -> Iterator[openai.OpenAI]:
        with make_sdk(faulty.url, KEY_A).with_options(timeout=STREAM_TIMEOUT) as client:
            yield client


HEARTBEAT_SECONDS = 0.5


class TestRedisDown(_StackOfItsOwn):
    """Redis stopped for a few seconds (well within RESPOOL_REDIS_OUTAGE_SECONDS): what needs it
    anew is a quick 503, while open streams stay open with their heartbeats and a waiting
    foreground create keeps waiting; once it is back (its AOF intact), those streams go on gapless
    to their terminal event, the create answers, earlier responses replay whole and new work flows."""

    @pytest.fixture(scope="class")
    @classmethod
    def scene(
        cls, servers: Restartable, faulty: Stack, sdk: openai.OpenAI, patient_sdk: openai.OpenAI
    ) -> Iterator[Scene]:
        scene = stage(sdk)
        with ThreadPoolExecutor(4) as pool:
            for response_id in (scene.live, scene.in_flight[-1]):
                started = threading.Event()
                scene.readers[response_id] = pool.submit(read_stream, patient_sdk, response_id, started)
                assert started.wait(CLIENT_TIMEOUT), f"no event came on {response_id}'s stream"
            started = threading.Event()
            scene.raw = pool.submit(read_raw_stream, faulty, scene.in_flight[-1], started)
            assert started.wait(CLIENT_TIMEOUT), "no event came on the raw stream"
            scene.foreground, scene.foreground_id = start_foreground(pool, servers, patient_sdk)
            scene.stopped_at = time.monotonic()  # before the API can notice
            servers.stop_redis()
            yield scene
        if servers.redis is None:
            servers.start_redis()

    @pytest.mark.parametrize("route", ROUTES)
    def test_routes_answer_503_quickly_or_from_postgres(
        self, servers: Restartable, sdk: openai.OpenAI, scene: Scene, route: str
    ) -> None:
        """Reads Postgres serves alone still answer (a poll of a live background response too: its
        row's word, the lease that says a worker holds it being out of reach); every other route
        answers 503 with retry-after, and a create records nothing."""
        if route in {"retrieve", "input_items"}:
            assert ROUTES[route](sdk, scene)  # the Response, or a page of its input items
            if route == "retrieve":
                assert sdk.responses.retrieve(scene.live).id == scene.live
            return
        rows = row_count(servers)
        error = assert_503(lambda: ROUTES[route](sdk, scene))
        assert error.response.headers.get("x-should-retry") != "false"
        if route in CREATES:
            assert row_count(servers) == rows  # refused before anything was written: safe to retry

    def test_alive_but_not_ready(self, faulty: Stack, scene: Scene) -> None:
        """/healthz stays 200 while Redis is down; /readyz says 503."""
        assert (probe(faulty, "/healthz"), probe(faulty, "/readyz")) == (200, 503)

    def test_open_streams_and_a_waiting_create_stay_open(self, scene: Scene) -> None:
        """Streams open when Redis goes, and a foreground create waiting for its end, are still
        waiting a few heartbeats later: nothing ended them."""
        assert scene.foreground is not None
        wait_for(
            lambda: time.monotonic() - scene.stopped_at > 4 * HEARTBEAT_SECONDS,
            what="a few heartbeats of outage",
        )
        assert scene.raw is not None
        waiting = [*scene.readers.values(), scene.raw, scene.foreground]
        assert not any(future.done() for future in waiting), [f.result() for f in waiting if f.done()]

    def test_back_with_nothing_lost(
        self, servers: Restartable, faulty: Stack, sdk: openai.OpenAI, scene: Scene
    ) -> None:
        """Once Redis is back, the streams open across the outage go on gapless to their terminal
        event with no `error` event, the raw one having had its heartbeats meanwhile; the waiting
        create answers its completed Response; earlier responses replay whole, and each in flight
        ended once."""
        servers.start_redis()
        restarted_at = time.monotonic()
        assert probe(faulty, "/readyz") == 200
        assert_recovered(faulty, sdk, scene)  # the live one cancelled, the rest ended once
        for response_id, reader in scene.readers.items():
            events = reader.result(timeout=STREAM_TIMEOUT)
            assert [e.sequence_number for e in events] == list(range(len(events))), response_id
            ends = [e.type for e in events if e.type in TERMINAL_EVENTS or e.type == "error"]
            assert ends == [events[-1].type] and ends[0] in TERMINAL_EVENTS, ends
        assert scene.raw is not None
        frames = scene.raw.result(timeout=STREAM_TIMEOUT)
        numbers = [number for _, number in frames if number is not None]
        assert numbers == list(range(len(numbers)))
        heard = [at for at, number in frames if number is None]  # a heartbeat's arrival
        assert any(scene.stopped_at < at < restarted_at for at in heard), (scene.stopped_at, heard)
        assert scene.foreground is not None
        foreground = scene.foreground.result(timeout=STREAM_TIMEOUT)
        assert (foreground.id, foreground.status) == (scene.foreground_id, "completed")
        assert_one_end(sdk, scene.foreground_id)
        replay = list(sdk.responses.retrieve(scene.done.id, stream=True))
        assert [(e.sequence_number, e.type) for e in replay] == [
            (e.sequence_number, e.type) for e in scene.done_events
        ]


class TestRedisDownPastTheBound(_StackOfItsOwn):
    """Redis stopped for longer than RESPOOL_REDIS_OUTAGE_SECONDS (3 s here): open streams end with
    an `error` event that says how long Redis was away and where to resume, a waiting foreground
    create answers 503 naming its response, not to be retried; once Redis is back, the stream
    resumes gapless from where it ended."""

    ENV = {"RESPOOL_REDIS_OUTAGE_SECONDS": "3"}

    @pytest.fixture(scope="class")
    @classmethod
    def scene(cls, servers: Restartable, sdk: openai.OpenAI, patient_sdk: openai.OpenAI) -> Iterator[Scene]:
        scene = stage(sdk, lengths=(300,))
        with ThreadPoolExecutor(2) as pool:
            started = threading.Event()
            response_id = scene.in_flight[0]
            scene.readers[response_id] = pool.submit(read_stream, patient_sdk, response_id, started)
            assert started.wait(CLIENT_TIMEOUT), f"no event came on {response_id}'s stream"
            scene.foreground, scene.foreground_id = start_foreground(pool, servers, patient_sdk)
            scene.stopped_at = time.monotonic()  # before the API can notice
            servers.stop_redis()
            yield scene
        if servers.redis is None:
            servers.start_redis()

    def test_open_streams_end_with_an_error_event_naming_the_outage(self, scene: Scene) -> None:
        """A stream open when Redis goes ends, past the bound and not before, with a flat `error`
        event repeating its cursor, naming the seconds Redis was unreachable and where to resume."""
        (events,) = (reader.result(timeout=STREAM_TIMEOUT / 2) for reader in scene.readers.values())
        assert time.monotonic() - scene.stopped_at >= 3
        *before, last = events
        assert (last.type, last.code) == ("error", "service_unavailable")  # type: ignore[union-attr]
        assert last.sequence_number == before[-1].sequence_number  # the cursor, repeated
        message = last.message  # type: ignore[union-attr]
        assert re.search(r"Redis was unreachable for \d+ s", message), message
        assert "RESPOOL_REDIS_OUTAGE_SECONDS" in message
        assert f"starting_after={before[-1].sequence_number}" in message

    def test_foreground_wait_answers_503_that_is_not_retried(self, scene: Scene) -> None:
        """A foreground create waiting when Redis goes answers, past the bound, 503 with
        x-should-retry: false, naming its response and the outage."""
        assert scene.foreground is not None
        with pytest.raises(openai.InternalServerError) as caught:
            scene.foreground.result(timeout=STREAM_TIMEOUT / 2)
        error = caught.value
        assert (error.status_code, error.code) == (503, "service_unavailable")
        assert error.response.headers["x-should-retry"] == "false"
        assert error.response.headers["retry-after"] == RETRY_AFTER
        assert scene.foreground_id in error.message
        assert re.search(r"Redis was unreachable for \d+ s", error.message), error.message

    def test_back_the_stream_resumes_where_it_ended(
        self, servers: Restartable, sdk: openai.OpenAI, scene: Scene
    ) -> None:
        """Once Redis is back, the stream resumed after the error event's cursor is gapless to its
        terminal event, and each response ended once."""
        servers.start_redis()
        for response_id, reader in scene.readers.items():
            *before, _error = reader.result(timeout=0)
            after = before[-1].sequence_number
            rest = list(sdk.responses.retrieve(response_id, stream=True, starting_after=after))
            assert [e.sequence_number for e in rest] == list(range(after + 1, after + 1 + len(rest)))
            assert rest and rest[-1].type in TERMINAL_EVENTS
            assert_one_end(sdk, response_id)
        assert_one_end(sdk, scene.foreground_id)


def read_stream(sdk: openai.OpenAI, response_id: str, started: threading.Event) -> list[ResponseStreamEvent]:
    """Every event a stream of `response_id` gives until it ends."""
    events = []
    for event in sdk.responses.retrieve(response_id, stream=True):
        events.append(event)
        started.set()
    return events


def read_raw_stream(
    stack: Stack, response_id: str, started: threading.Event
) -> list[tuple[float, int | None]]:
    """A stream of `response_id` read frame by frame, as `(arrival, sequence_number)` for each
    event, with None as the number of a comment (a heartbeat, PROTOCOL.md §5.3)."""
    frames: list[tuple[float, int | None]] = []
    headers = {"authorization": f"Bearer {KEY_A}"}
    url = f"{stack.url}/v1/responses/{response_id}?stream=true"
    with httpx.stream("GET", url, headers=headers, timeout=STREAM_TIMEOUT) as answer:
        for line in answer.iter_lines():
            if line.startswith(":"):
                frames.append((time.monotonic(), None))
            elif line.startswith("data: "):
                frames.append((time.monotonic(), orjson.loads(line[6:])["sequence_number"]))
                started.set()
    return frames


def start_foreground(
    pool: ThreadPoolExecutor, servers: Restartable, sdk: openai.OpenAI
) -> tuple[Future[Response], str]:
    """A foreground create, once the API waits on it: its future and its response id."""
    with Redis.from_url(servers.redis_url) as redis:
        known = set(redis.scan_iter(match=events_key("*")))
        future = pool.submit(sdk.responses.create, model="synthetic", input=words(150))

        def started() -> str | None:
            """A worker holds it: its lease is taken (a foreground response not streamed appends
            nothing until its model turn ends, `ResponseWriter.defer`)."""
            for key in set(redis.scan_iter(match=events_key("*"))) - known:
                response_id = re.search(rb"resp_\w+", key)[0].decode()  # type: ignore[index]
                if redis.exists(lease_key(response_id)):
                    return response_id
            return None

        return future, wait_for(started, what="the foreground response to start")


class TestRedisComesBackEmpty:
    """Redis restarted without its data: new work flows, and what was in flight ends `failed`."""

    @pytest.fixture(scope="class")
    @classmethod
    def scene(cls, servers: Restartable, sdk: openai.OpenAI, patient_sdk: openai.OpenAI) -> Iterator[Scene]:
        scene = stage(sdk, lengths=(100, 200))
        with ThreadPoolExecutor(1) as pool:
            started = threading.Event()
            response_id = scene.in_flight[-1]
            scene.readers[response_id] = pool.submit(read_stream, patient_sdk, response_id, started)
            assert started.wait(CLIENT_TIMEOUT), f"no event came on {response_id}'s stream"
            servers.stop_redis()
            servers.start_redis(is_empty=True)
            yield scene

    def test_open_streams_end_with_an_error_event_saying_their_events_are_lost(self, scene: Scene) -> None:
        """A stream open across the restart ends with a flat `error` event saying Redis lost its
        events (not resumable: retrieve the response), instead of waiting on a stream that no
        longer exists."""
        (events,) = (reader.result(timeout=STREAM_TIMEOUT / 2) for reader in scene.readers.values())
        *before, last = events
        assert (last.type, last.code) == ("error", "service_unavailable")  # type: ignore[union-attr]
        assert last.sequence_number == before[-1].sequence_number
        message = last.message  # type: ignore[union-attr]
        assert "lost its data" in message and "retrieve the response by id" in message, message

    def test_new_work_flows(self, faulty: Stack, sdk: openai.OpenAI, scene: Scene) -> None:
        """Creates of every kind work on the empty Redis at once."""
        assert sdk.responses.create(model="synthetic", input="again").status == "completed"
        events = list(sdk.responses.create(model="synthetic", input="again", stream=True))
        assert events[-1].type == "response.completed"
        fresh = sdk.responses.create(model="synthetic", input="again", background=True)
        assert settled(sdk, fresh.id).status == "completed"
        assert_worker_alive(faulty)

    def test_finished_responses_survive_in_postgres(self, sdk: openai.OpenAI, scene: Scene) -> None:
        """A response finished before stays retrievable; its lost events are a 400, not a hang."""
        again = sdk.responses.retrieve(scene.done.id)
        assert (again.status, again.output_text) == ("completed", scene.done.output_text)
        with pytest.raises(openai.BadRequestError):
            list(sdk.responses.retrieve(scene.done.id, stream=True))

    def test_in_flight_responses_end_failed(self, faulty: Stack, sdk: openai.OpenAI, scene: Scene) -> None:
        """Every response that was queued or running when Redis lost its data ends `failed`, once."""
        for response_id in [scene.live, *scene.in_flight]:
            assert assert_one_end(sdk, response_id).status == "failed"
        assert_worker_alive(faulty)


def test_a_frozen_redis_is_a_503_not_a_hang(servers: Restartable, sdk: openai.OpenAI) -> None:
    """While Redis is alive but silent (stopped with SIGSTOP), a create answers 503 after the API's
    Redis timeout instead of waiting on it for ever, records nothing (safe to retry), and works
    again once Redis does."""
    assert servers.redis is not None
    rows = row_count(servers)
    servers.redis.process.send_signal(signal.SIGSTOP)
    try:
        error = assert_503(lambda: sdk.responses.create(model="synthetic", input="x", background=True))
    finally:
        servers.redis.process.send_signal(signal.SIGCONT)
    assert error.response.headers.get("x-should-retry") != "false"
    assert row_count(servers) == rows
    fresh = sdk.responses.create(model="synthetic", input="after the freeze", background=True)
    assert settled(sdk, fresh.id).status == "completed"


def test_a_create_whose_enqueue_times_out_is_taken_back_and_may_be_retried(
    servers: Restartable, sdk: openai.OpenAI
) -> None:
    """A create whose enqueue times out takes its row back: a 503 the SDK may retry, nothing left
    recorded (had Redis queued it after all, its worker would find no row: tests/worker/runner/
    test_recovery.py), and the next create works."""
    rows = row_count(servers)
    with Redis.from_url(servers.redis_url) as redis:
        # Writes wait (reads do not) longer than the API's 2 s Redis timeout.
        redis.execute_command("CLIENT", "PAUSE", "4000", "WRITE")
        try:
            error = assert_503(lambda: sdk.responses.create(model="synthetic", input="x", background=True))
        finally:
            redis.execute_command("CLIENT", "UNPAUSE")
    assert error.response.headers.get("x-should-retry") != "false"
    assert row_count(servers) == rows
    fresh = sdk.responses.create(model="synthetic", input="after the pause", background=True)
    assert settled(sdk, fresh.id).status == "completed"


# Postgres refuses the insert of a create marked so (metadata refuse=yes), as it would one it cannot take.
_REFUSE_MARKED = """
CREATE FUNCTION refuse_marked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.request -> 'metadata' ->> 'refuse' = 'yes' THEN RAISE EXCEPTION 'refused for the test'; END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER refuse_marked BEFORE INSERT ON response FOR EACH ROW EXECUTE FUNCTION refuse_marked();
"""


def test_a_create_whose_insert_fails_after_its_enqueue_takes_the_response_back(
    servers: Restartable, faulty: Stack, sdk: openai.OpenAI
) -> None:
    """A create queues its response while it inserts the row (DESIGN.md §2.1): when Postgres refuses
    the insert, the response is taken out of the queue (or, when a worker took it already, stopped
    by its cancel flag and left to expire), nothing is recorded, and the client gets an error."""
    engine = sa.create_engine(async_url(servers.database_url), poolclass=NullPool)
    rows = row_count(servers)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(_REFUSE_MARKED)
        for _ in range(5):
            with pytest.raises(openai.InternalServerError):
                sdk.with_options(max_retries=0).responses.create(
                    model="synthetic", input="x", metadata={"refuse": "yes"}
                )
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER refuse_marked ON response; DROP FUNCTION refuse_marked();")
        engine.dispose()
    assert row_count(servers) == rows
    queue = faulty.env["RESPOOL_QUEUE"]
    with Redis.from_url(servers.redis_url) as redis:

        def refused() -> list[str]:
            """The refused creates' responses whose first events are still in Redis."""
            found = []
            for key in redis.scan_iter(match="respool:{resp_*}:events", count=1000):
                first = redis.xrange(key, count=1)
                if first and b'"refuse":"yes"' in first[0][1][b"d"]:
                    found.append(key.decode().split("{")[1].split("}")[0])
            return found

        def settled() -> bool:
            held = QueueView(redis, queue).held()
            return all(
                response_id not in held and redis.ttl(events_key(response_id)) > 0
                for response_id in refused()
            )

        # Well within the 10 s a worker waits for a row that never came (attempt.ROW_WAIT_SECONDS).
        wait_for(settled, timeout=7, what="the refused responses out of the queue, their keys expiring")
        assert not redis.lrange(queue_key(queue), 0, -1)


def test_an_api_started_while_redis_is_down_serves_once_it_is_back(
    servers: Restartable, faulty: Stack, sdk: openai.OpenAI
) -> None:
    """An API process started while Redis is down comes up (healthy, not ready, 503s), and serves
    streams once Redis is back."""
    servers.stop_redis()
    try:
        url = faulty.start_api("api-started-early")
        assert httpx.get(url + "/readyz", timeout=CLIENT_TIMEOUT).status_code == 503
        with make_sdk(url, KEY_A) as early:
            assert_503(lambda: early.responses.create(model="synthetic", input="x"))
    finally:
        servers.start_redis()
    with make_sdk(url, KEY_A) as early:
        wait_for(lambda: httpx.get(url + "/readyz", timeout=CLIENT_TIMEOUT).status_code == 200, what="ready")
        events = list(early.responses.create(model="synthetic", input="after", stream=True))
    assert events[-1].type == "response.completed"
    faulty.stop("api-started-early")
