"""The sweep (worker/runner/recovery.py) on real Redis and Postgres: every in-progress row is looked at in
each sweep, so an orphan is ended even behind many held ones; queued rows, a backlog of any depth,
are paged through a bounded number of pages per sweep, from where the last sweep stopped, starting
over after the newest. Responses whose holder missed its deadline are put back in the queue, or
given up after their last attempt; what a dead worker had popped goes back.

On a database of its own: the session's database has other stacks' workers sweeping it, which
would end the orphans first (and the counts these tests assert would be theirs)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from redis import Redis
from rq.job import Job, JobStatus
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.support.queue import QueueView
from tests.support.stack import Servers, fresh_database
from tests.support.webhook_receiver import Receiver
from worker.errors import ConfigError
from worker.keys import attempt_key, held_key, lease_key, queue_key, queued_key, taking_key, workers_key
from worker.postgres import deliveries
from worker.postgres.store import async_url
from worker.queue import job_statuses
from worker.runner.deliveries import Deliverer, queue_due
from worker.runner.recovery import GIVEN_UP, end_orphans, take_back
from worker.runner.runtime import Runtime, close_runtime, open_runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration

HELD = 5


@pytest.fixture
def database(backing: Servers) -> Iterator[str]:
    with fresh_database(backing.database_url) as url:
        yield url


@pytest.fixture
def settings(backing: Servers, database: str) -> Settings:
    return Settings(
        redis_url=backing.redis_url, database_url=database, queue=f"respool-sweep-{uuid.uuid4().hex[:8]}"
    )


@pytest.fixture
def redis(backing: Servers) -> Iterator[Redis]:
    with Redis.from_url(backing.redis_url) as connection:
        yield connection


@pytest.fixture
def held(redis: Redis, settings: Settings) -> Iterator[list[str]]:
    """HELD response ids a queue holds (waiting: a worker will run them): the first in this
    sweep's queue, the others in another deployment's (a queue of its own on the same Redis and
    Postgres), which this sweep must leave alone too."""
    ids = [f"resp_{settings.queue.replace('-', '')}held{index}" for index in range(HELD)]
    redis.zadd(held_key(settings.queue), {ids[0]: float("inf")})
    redis.zadd(held_key(f"{settings.queue}-other"), dict.fromkeys(ids[1:], float("inf")))
    for index, response_id in enumerate(ids):
        redis.set(queued_key(response_id), settings.queue if index == 0 else f"{settings.queue}-other")
    yield ids
    redis.delete(held_key(settings.queue), held_key(f"{settings.queue}-other"), *map(queued_key, ids))


def _insert_live(database_url: str, status: str, response_ids: list[str], oldest: int = 120) -> None:
    """Rows in `status` created `oldest` seconds ago and after (past the sweep's grace), in this order."""
    engine = create_engine(async_url(database_url), poolclass=NullPool)
    with engine.begin() as conn:
        for age, response_id in enumerate(response_ids):
            conn.execute(
                text(
                    "INSERT INTO response (id, owner, status, model, background, store, stream, request, "
                    "conversation, response, created_at) VALUES (:id, 'sweep', :status, 'm', true, true, "
                    "false, '{}', '[]', :response, now() - make_interval(secs => :oldest - :age))"
                ),
                {
                    "id": response_id,
                    "status": status,
                    "age": age,
                    "oldest": oldest,
                    "response": f'{{"id": "{response_id}", "status": "{status}"}}',
                },
            )


def _statuses(database_url: str, response_ids: list[str]) -> dict[str, str]:
    engine = create_engine(async_url(database_url), poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM response WHERE id = ANY(:ids)"), {"ids": response_ids}
        )
        return {row.id: row.status for row in rows}


async def _sweep(backing: Servers, settings: Settings, pages: int) -> int:
    """One pass of end_orphans in pages of 2; the number it ended."""
    rt = await open_runtime(settings, f"test:{settings.queue}", 1)
    try:
        return await end_orphans(rt, settings, batch=2, pages=pages)
    finally:
        await close_runtime(rt)


@pytest.mark.parametrize("status", ["queued", "in_progress"])
async def test_an_orphan_behind_held_responses_is_ended(
    backing: Servers, settings: Settings, held: list[str], status: str
) -> None:
    """Pages of 2: the 5 oldest rows are held by the queue (left alone); the orphan after them,
    which the queue no longer holds, is ended failed in one sweep."""
    orphan = f"{held[0]}orphan"
    _insert_live(settings.database_url, status, [*held, orphan])
    assert await _sweep(backing, settings, pages=4) == 1
    assert _statuses(settings.database_url, [*held, orphan]) == {
        **dict.fromkeys(held, status),
        orphan: "failed",
    }


async def test_each_sweep_reads_a_few_pages_of_queued_rows_on_from_the_last(
    backing: Servers, settings: Settings, held: list[str]
) -> None:
    """One page of 2 queued rows per sweep: the orphan 6th in line is ended by the 3rd sweep, not
    before; after the newest the next sweep starts over, and finds an orphan older than all."""
    orphan, older = f"{held[0]}orphan", f"{held[0]}older"
    _insert_live(settings.database_url, "queued", [*held, orphan])
    assert [await _sweep(backing, settings, pages=1) for _ in range(3)] == [0, 0, 1]
    _insert_live(settings.database_url, "queued", [older], oldest=600)
    assert await _sweep(backing, settings, pages=1) == 0  # past the newest: an empty page
    assert await _sweep(backing, settings, pages=1) == 1  # from the start again
    assert _statuses(settings.database_url, [*held, orphan, older]) == {
        **dict.fromkeys(held, "queued"),
        orphan: "failed",
        older: "failed",
    }


async def test_in_progress_orphans_are_all_ended_in_one_sweep_whatever_the_queued_backlog(
    backing: Servers, settings: Settings, held: list[str]
) -> None:
    """A queued backlog read one page at a time does not hold back in-progress orphans."""
    in_progress = [f"{held[0]}running{index}" for index in range(5)]
    _insert_live(settings.database_url, "queued", held)
    _insert_live(settings.database_url, "in_progress", in_progress)
    assert await _sweep(backing, settings, pages=1) == 5
    assert _statuses(settings.database_url, in_progress) == dict.fromkeys(in_progress, "failed")


async def test_responses_past_their_deadline_are_put_back_or_given_up(
    redis: Redis, settings: Settings
) -> None:
    """Running responses whose holder missed its deadline: one still leased (a late heartbeat) gets
    a new deadline; unleased ones go back to the front of the queue, as waiting, unless they have run
    `max_attempts` times: that one is ended failed, saying so, and leaves the queue. One within its
    deadline, and waiting ones, are left alone."""
    prefix = f"resp_{settings.queue.replace('-', '')}"
    late, abandoned, spent, on_time, waiting = (
        f"{prefix}{name}" for name in ("late", "gone", "spent", "ontime", "wait")
    )
    _insert_live(settings.database_url, "in_progress", [late, abandoned, spent, on_time])
    queue = QueueView(redis, settings.queue)
    past = 1000.0  # ms since the epoch: long past
    redis.zadd(
        held_key(settings.queue),
        {late: past, abandoned: past, spent: past, on_time: 1e15, waiting: float("inf")},
    )
    redis.rpush(queue_key(settings.queue), waiting)
    redis.set(lease_key(late), "1:someone", px=60_000)
    redis.set(attempt_key(abandoned), settings.max_attempts - 1)
    redis.set(attempt_key(spent), settings.max_attempts)
    redis.set(queued_key(spent), settings.queue)
    rt = await open_runtime(settings, f"test:{settings.queue}", 1)
    try:
        assert await take_back(rt, settings.max_attempts) == 1
    finally:
        await close_runtime(rt)
    assert queue.waiting() == [abandoned, waiting]
    held = queue.held()
    assert held[abandoned] == float("inf") and held[waiting] == float("inf")
    assert held[late] > past and held[on_time] == 1e15
    assert spent not in held and not redis.exists(queued_key(spent))
    assert _statuses(settings.database_url, [late, abandoned, spent, on_time]) == {
        late: "in_progress", abandoned: "in_progress", spent: "failed", on_time: "in_progress"
    }  # fmt: skip
    engine = create_engine(async_url(settings.database_url), poolclass=NullPool)
    with engine.connect() as conn:
        failed = conn.execute(text("SELECT response FROM response WHERE id = :id"), {"id": spent}).one()
    assert failed.response["error"]["message"] == GIVEN_UP


async def test_what_a_dead_worker_popped_goes_back_to_the_front(redis: Redis, settings: Settings) -> None:
    """A worker that stopped beating (its time in the workers' set is past) had popped two responses
    and leased neither: both go back to the front of the queue, in their order, and the worker
    leaves the set. A live worker's taking list is left alone."""
    prefix = f"resp_{settings.queue.replace('-', '')}"
    queue = QueueView(redis, settings.queue)
    redis.rpush(queue_key(settings.queue), f"{prefix}next")
    redis.rpush(taking_key(settings.queue, "dead"), f"{prefix}a", f"{prefix}b")
    redis.rpush(taking_key(settings.queue, "alive"), f"{prefix}c")
    redis.zadd(workers_key(settings.queue), {"dead": 1000, "alive": 1e15})
    rt = await open_runtime(settings, f"test:{settings.queue}", 1)
    try:
        await take_back(rt, settings.max_attempts)
    finally:
        await close_runtime(rt)
    assert queue.waiting() == [f"{prefix}a", f"{prefix}b", f"{prefix}next"]
    assert queue.taking("dead") == [] and queue.taking("alive") == [f"{prefix}c"]
    assert queue.workers() == {"alive"}


async def test_an_orphan_the_sweep_ends_tells_its_owner_once(
    backing: Servers, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background orphan ended by the sweep records one `response.failed` delivery in the same
    transaction (a second sweep adds none), which a worker's attempt delivers, signed."""
    secret = "whsec_" + base64.b64encode(b"sweep").decode()
    monkeypatch.setenv("RESPOOL_WEBHOOK_SECRET", secret)
    orphan = f"resp_{settings.queue.replace('-', '')}orphan"
    _insert_live(settings.database_url, "queued", [orphan])
    with Receiver.start() as receiver:
        hooked = settings.model_copy(
            update={"webhook_url": receiver.url, "outbound_allowlist": receiver.host_port}
        )
        assert await _sweep(backing, hooked, pages=4) == 1
        assert await _sweep(backing, hooked, pages=4) == 0
        rt = await open_runtime(hooked, "test:deliver", 1)
        deliverer = Deliverer(hooked, rt.engine, rt.redis, rt.notifier, rt.outbound, rt.metrics)
        try:
            async with rt.engine.connect() as conn:
                (delivery_id,) = await deliveries.due(conn, ["default"], 10)
            await deliverer.deliver(delivery_id)
        finally:
            await deliverer.close()
            await close_runtime(rt)
        (got,) = receiver.deliveries
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(got.body, got.headers, secret=secret)
    assert (event.type, event.data.id, event.id) == ("response.failed", orphan, delivery_id)


async def _one_attempt(backing: Servers, settings: Settings, name: str) -> dict[str, Any]:
    """An orphan ended by the sweep, its delivery attempted once by a Deliverer: what was recorded."""
    orphan = f"resp_{settings.queue.replace('-', '')}{name}"
    _insert_live(settings.database_url, "queued", [orphan])
    assert await _sweep(backing, settings, pages=4) == 1
    rt = await open_runtime(settings, "test:deliver", 1)
    deliverer = Deliverer(settings, rt.engine, rt.redis, rt.notifier, rt.outbound, rt.metrics)
    try:
        async with rt.engine.connect() as conn:
            (delivery_id,) = await deliveries.due(conn, ["default"], 10)
        await deliverer.deliver(delivery_id)
        async with rt.engine.connect() as conn:
            (told,) = await deliveries.of_response(conn, orphan)
    finally:
        await deliverer.close()
        await close_runtime(rt)
    return told


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://169.254.169.254/latest/hook", "a link-local or cloud metadata address"),
        ("http://127.0.0.1:9/hook", "a loopback address"),
        ("http://10.1.2.3/hook", "a private address"),
    ],
)
async def test_a_webhook_endpoint_at_a_non_public_address_stops_the_worker_at_start(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, url: str, kind: str
) -> None:
    """The outbound rule (DESIGN.md §13) holds for the operator's webhook endpoints: one at a cloud
    metadata, loopback or private address is refused when the worker starts, naming the endpoint and
    the allowlist entry that would open it; the allowlist opens it."""
    monkeypatch.setenv("RESPOOL_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"ssrf").decode())
    hooked = settings.model_copy(update={"webhook_url": url})
    rt = await open_runtime(hooked, "test:ssrf", 1)
    try:
        with pytest.raises(ConfigError) as refused:
            Deliverer(hooked, rt.engine, rt.redis, rt.notifier, rt.outbound, rt.metrics)
        assert f"webhook endpoint 'default': '{urlsplit(url).hostname}' is {kind}" in str(refused.value)
        assert "RESPOOL_OUTBOUND_ALLOWLIST" in str(refused.value)
    finally:
        await close_runtime(rt)
    opened = hooked.model_copy(update={"outbound_allowlist": urlsplit(url).hostname})
    rt = await open_runtime(opened, "test:ssrf", 1)
    try:
        await Deliverer(opened, rt.engine, rt.redis, rt.notifier, rt.outbound, rt.metrics).close()
    finally:
        await close_runtime(rt)


async def test_a_webhook_endpoint_whose_name_resolves_to_a_loopback_address_is_refused_at_each_attempt(
    backing: Servers, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name is checked as it resolves, when the attempt connects: this machine's host name (which
    resolves to a loopback address) is refused, the attempt is recorded with the rule's reason and
    put off for a retry, and the receiver behind it gets nothing."""
    host = socket.gethostname()
    resolved = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, 80)}
    assert resolved and all(address.is_loopback for address in resolved), f"{host} -> {resolved}"
    monkeypatch.setenv("RESPOOL_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"ssrf").decode())
    with Receiver.start() as receiver:
        hooked = settings.model_copy(update={"webhook_url": f"http://{host}:{receiver.port}/hook"})
        told = await _one_attempt(backing, hooked, "ssrf")
        assert receiver.deliveries == []
    assert (told["status"], told["attempts"]) == ("pending", 1)
    assert f"could not reach the endpoint: '{host}' is a loopback address" in told["last_error"]
    assert told["attempt_log"][0]["error"] == told["last_error"]


async def test_a_receivers_retry_after_sets_when_the_next_attempt_is(
    backing: Servers, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 with `retry-after` (seconds, or an HTTP date) puts the next attempt that far off, instead
    of the backoff's (here at most 2 s)."""
    monkeypatch.setenv("RESPOOL_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"later").decode())
    in_a_minute = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    with Receiver.start() as receiver:
        hooked = settings.model_copy(
            update={
                "webhook_url": receiver.url,
                "outbound_allowlist": receiver.host_port,
                "webhook_backoff_seconds": 1.0,
                "webhook_backoff_max_seconds": 3600.0,
            }
        )
        for name, hint, waits in (("seconds", "30", 30), ("date", in_a_minute, 60)):
            receiver.answers = [(503, {"retry-after": hint})]
            told = await _one_attempt(
                backing, hooked.model_copy(update={"queue": f"{settings.queue}{name}"}), name
            )
            (attempt,) = told["attempt_log"]
            assert (told["status"], attempt["status_code"]) == ("pending", 503)
            put_off = (told["next_attempt_at"] - datetime.fromisoformat(attempt["at"])).total_seconds()
            assert waits - 3 <= put_off <= waits + 1, (name, put_off)


async def test_a_receiver_that_does_not_answer_in_time_is_an_attempt_failed(
    backing: Servers, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read timeout bounds an attempt: a receiver that answers only after it is recorded as an
    attempt with no status code, saying so, and retried."""
    monkeypatch.setenv("RESPOOL_WEBHOOK_SECRET", "whsec_" + base64.b64encode(b"slow").decode())
    with Receiver.start() as receiver:
        receiver.delay = 3.0
        hooked = settings.model_copy(
            update={
                "webhook_url": receiver.url,
                "outbound_allowlist": receiver.host_port,
                "webhook_timeout_seconds": 0.5,
            }
        )
        told = await _one_attempt(backing, hooked, "slow")
    (attempt,) = told["attempt_log"]
    assert (told["status"], attempt["status_code"]) == ("pending", None)
    assert attempt["error"] == "no answer within 0.5 s"
    assert 400 <= attempt["duration_ms"] < 3000


@contextlib.asynccontextmanager
async def _unqueued_delivery(
    backing: Servers, settings: Settings, monkeypatch: pytest.MonkeyPatch, name: str
) -> AsyncIterator[tuple[Runtime, str]]:
    """A background orphan's delivery, recorded as the sweep ends it and queued by the sweep's
    process, then taken out of RQ (as if its send were under way, or had failed): a runtime with
    its endpoint, and the delivery's id."""
    monkeypatch.setenv("RESPOOL_WEBHOOK_SECRET", "whsec_" + base64.b64encode(name.encode()).decode())
    _insert_live(settings.database_url, "queued", [f"resp_{settings.queue.replace('-', '')}{name}"])
    with Receiver.start() as receiver:
        hooked = settings.model_copy(
            update={"webhook_url": receiver.url, "outbound_allowlist": receiver.host_port}
        )
        assert await _sweep(backing, hooked, pages=4) == 1
        rt = await open_runtime(hooked, f"test:{name}", 1)
        try:
            async with rt.engine.connect() as conn:
                (delivery_id,) = await deliveries.due(conn, ["default"], 10)
            jobs = rt.notifier.queue
            assert job_statuses(jobs, [delivery_id]) == {delivery_id: JobStatus.QUEUED}
            jobs.remove(delivery_id)
            jobs.connection.delete(Job.key_for(delivery_id))
            yield rt, delivery_id
        finally:
            await close_runtime(rt)


async def test_a_delivery_just_recorded_is_left_to_its_recorder_to_queue(
    backing: Servers, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever records a delivery with a response's end queues it right after the commit; the sweep,
    finding no job for one, queues it only once it has settled (SEND_SETTLE_SECONDS): sooner,
    another worker's sweep queued it a second time while its send was under way."""
    async with _unqueued_delivery(backing, settings, monkeypatch, "settle") as (rt, delivery_id):
        jobs = rt.notifier.queue
        statuses = partial(job_statuses, jobs)
        assert await queue_due(rt.autocommit, rt.notifier, statuses, None) == 0
        assert job_statuses(jobs, [delivery_id]) == {delivery_id: None}
        assert await queue_due(rt.autocommit, rt.notifier, statuses, None, settled_seconds=0) == 1
        assert job_statuses(jobs, [delivery_id]) == {delivery_id: JobStatus.QUEUED}


async def test_workers_alike_queue_a_due_delivery_once(
    backing: Servers, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers' sweeps at once, each finding a due delivery without a job: the one that takes the
    lock of the workers configuring the same endpoints queues it; the other, nothing."""
    async with _unqueued_delivery(backing, settings, monkeypatch, "alike") as (rt, delivery_id):
        jobs = rt.notifier.queue
        both_read = threading.Barrier(2)

        def statuses(ids: Sequence[str]) -> dict[str, JobStatus | None]:
            """RQ's word, then a wait for the other sweep's (1 s at most): both read before either
            queues, as two sweeps at once do."""
            found = job_statuses(jobs, list(ids))
            with contextlib.suppress(threading.BrokenBarrierError):
                both_read.wait(timeout=1)
            return found

        sweeps = [
            queue_due(rt.autocommit, rt.notifier, statuses, None, 0, holder=worker, lock_ms=2000)
            for worker in ("worker-a", "worker-b")
        ]
        assert sorted(await asyncio.gather(*sweeps)) == [0, 1]
        assert jobs.get_job_ids().count(delivery_id) == 1
