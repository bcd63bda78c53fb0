"""The sweep (worker/recovery.py) on real Redis and Postgres: it looks at every live row, so an
orphan is ended even behind a backlog of queued responses that RQ still holds.

On a database of its own: the session's database has other stacks' workers sweeping it, which
would end the orphan first (and the count this test asserts would be theirs)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from redis import Redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.support.stack import Servers, _fresh_database
from worker.migrate import migrate
from worker.queue import job_statuses, response_queue
from worker.recovery import end_orphans
from worker.runner import close_runtime, open_runtime
from worker.settings import Settings
from worker.store import async_url

pytestmark = pytest.mark.integration

HELD = 5


@pytest.fixture
def database(backing: Servers) -> Iterator[str]:
    url, drop = _fresh_database(backing.database_url)
    migrate(url)
    yield url
    drop()


def _insert_live(database_url: str, response_ids: list[str]) -> None:
    """Queued rows created a minute ago (past the sweep's grace), in this order."""
    engine = create_engine(async_url(database_url), poolclass=NullPool)
    with engine.begin() as conn:
        for age, response_id in enumerate(response_ids):
            conn.execute(
                text(
                    "INSERT INTO response (id, owner, status, model, background, store, stream, request, "
                    "conversation, response, created_at) VALUES (:id, 'sweep', 'queued', 'm', true, true, "
                    "false, '{}', '[]', :response, now() - make_interval(secs => 120 - :age))"
                ),
                {"id": response_id, "age": age, "response": f'{{"id": "{response_id}", "status": "queued"}}'},
            )


def _statuses(database_url: str, response_ids: list[str]) -> dict[str, str]:
    engine = create_engine(async_url(database_url), poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status FROM response WHERE id = ANY(:ids)"), {"ids": response_ids}
        )
        return {row.id: row.status for row in rows}


async def test_an_orphan_behind_a_backlog_of_held_responses_is_ended(backing: Servers, database: str) -> None:
    """Pages of 2: the 5 oldest rows are queued in RQ (held, left alone); the orphan after them,
    whose job RQ no longer has, is ended failed."""
    tag = uuid.uuid4().hex[:8]
    held = [f"resp_sweep{tag}held{index}" for index in range(HELD)]
    orphan = f"resp_sweep{tag}orphan"
    _insert_live(database, [*held, orphan])
    settings = Settings(redis_url=backing.redis_url, database_url=database, queue=f"respool-sweep-{tag}")
    with Redis.from_url(backing.redis_url) as connection:
        queue = response_queue(connection, settings.queue)
        jobs = [
            Job.create(
                "builtins.print",
                id=response_id,
                connection=connection,
                serializer=JSONSerializer,
                status=JobStatus.QUEUED,
            )
            for response_id in held
        ]
        for job in jobs:
            job.save()
        rt = await open_runtime(settings, f"test:{tag}", 1)
        try:
            ended = await end_orphans(rt, settings, lambda ids: job_statuses(queue, ids), batch=2)
        finally:
            await close_runtime(rt)
            for job in jobs:
                job.delete()
    assert _statuses(database, [*held, orphan]) == {
        **dict.fromkeys(held, "queued"),
        orphan: "failed",
    }
    assert ended == 1
