"""Client-side deadlines and unprepared statements on real Postgres (worker/postgres/direct.py): a
statement past its deadline raises an outage at its deadline, on libpq itself, through psycopg and
through the engine, and its connection is not used again; a pool that does not prepare leaves no
prepared statement on its server connections (a transaction pooler's need)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.outages import is_postgres_outage
from worker.postgres import direct, store
from worker.postgres.direct import DirectPool, StatementTimeoutError

pytestmark = pytest.mark.integration

DEADLINE = 0.5
_SLEEP = direct.Statement("sleep", "SELECT pg_sleep(%(seconds)s)")
_PID = "SELECT pg_backend_pid()"


@pytest.fixture
async def bounded(database: str) -> AsyncIterator[DirectPool]:
    """A direct pool of one connection whose statements get DEADLINE seconds."""
    pool = DirectPool(database, 1, deadline_seconds=DEADLINE)
    yield pool
    await pool.close()


@pytest.fixture
async def engine(database: str) -> AsyncIterator[AsyncEngine]:
    """An engine of one connection whose statements get DEADLINE seconds."""
    engine = store.create_engine(database, 1, deadline_seconds=DEADLINE)
    yield engine
    await engine.dispose()


async def _pid(pool: DirectPool) -> int:
    async with pool.connection() as conn:
        row = await (await conn.execute(_PID)).fetchone()
    assert row is not None
    return int(row[0])


async def _times_out(statement: Callable[[], Awaitable[object]]) -> BaseException:
    """The outage `statement` raises, checked to come at the deadline, not at the statement's end."""
    started = time.monotonic()
    with pytest.raises((StatementTimeoutError, DBAPIError)) as raised:
        await statement()
    assert DEADLINE <= time.monotonic() - started < DEADLINE + 1.0
    assert is_postgres_outage(raised.value)
    return raised.value


@pytest.mark.parametrize("through", ["libpq", "psycopg"])
async def test_a_statement_past_its_deadline_is_an_outage_and_its_connection_goes(
    bounded: DirectPool, through: str
) -> None:
    """On the direct pool (libpq itself or psycopg's cursor), a statement that outlasts its deadline
    raises StatementTimeoutError then, and the next statement runs on a new connection."""
    before = await _pid(bounded)

    async def sleeps() -> None:
        async with bounded.connection() as conn:
            if through == "libpq":
                await direct.run(conn, _SLEEP, {"seconds": "3"})
            else:
                await conn.execute("SELECT pg_sleep(3)")

    assert isinstance(await _times_out(sleeps), StatementTimeoutError)
    assert await _pid(bounded) != before


async def test_an_engine_statement_past_its_deadline_is_an_outage_and_its_connection_goes(
    engine: AsyncEngine,
) -> None:
    """Through the engine, a statement that outlasts its deadline raises an outage then, and the
    engine's next statement runs on a new connection (the timed-out one is invalidated)."""

    async def pid() -> int:
        async with engine.connect() as conn:
            return int((await conn.execute(text(_PID))).scalar_one())

    async def sleeps() -> None:
        async with engine.begin() as conn:
            await conn.execute(text("SELECT pg_sleep(3)"))

    before = await pid()
    raised = await _times_out(sleeps)
    assert isinstance(raised.__cause__, StatementTimeoutError)
    assert await pid() != before


async def test_a_deadline_spares_a_statement_that_answers_in_time(bounded: DirectPool) -> None:
    """A statement shorter than its deadline runs and keeps its connection."""
    before = await _pid(bounded)
    async with bounded.connection() as conn:
        await direct.run(conn, _SLEEP, {"seconds": "0.1"})
    assert await _pid(bounded) == before


@pytest.mark.parametrize("is_preparing", [True, False])
async def test_a_pool_that_does_not_prepare_leaves_nothing_prepared(
    database: str, is_preparing: bool
) -> None:
    """The hot statements and a query run ten times (psycopg prepares from the fifth) leave prepared
    statements on the server connection only where the pool prepares."""
    pool = DirectPool(database, 1, is_preparing=is_preparing)
    try:
        async with pool.connection() as conn:
            for _ in range(10):
                await store.get_view(conn, "resp_none", "nobody")
                await store.response_exists(conn, "resp_none")
            cursor = await conn.execute("SELECT name FROM pg_prepared_statements")
            prepared = [row[0] for row in await cursor.fetchall()]
    finally:
        await pool.close()
    assert bool(prepared) is is_preparing, prepared
    if is_preparing:
        assert "respool_view" in prepared
