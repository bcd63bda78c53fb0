"""The direct pool (worker/postgres/direct.py) on real Postgres: connections kept and reused, none
handed out mid-statement, the outage rule (a broken connection drops the idle ones, a connect that
fails raises at once, a pool with none free times out as an outage), and the hot statements'
JSON going through it and through an engine's transaction alike."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
import pytest
import uvloop

from worker.outages import is_postgres_outage
from worker.postgres import direct, store
from worker.postgres.direct import DirectPool, PoolTimeoutError, driver_url, shares
from worker.protocol.response import Status

pytestmark = pytest.mark.integration


async def _backend(pool: DirectPool) -> int:
    async with pool.connection() as conn:
        cursor = await conn.execute("SELECT pg_backend_pid()")
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])


async def _terminate(database: str, pid: int) -> None:
    async with await psycopg.AsyncConnection.connect(driver_url(database), autocommit=True) as admin:
        await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


async def test_a_connection_is_kept_and_reused(pool: DirectPool) -> None:
    assert await _backend(pool) == await _backend(pool)


@pytest.mark.parametrize("through", ["psycopg", "libpq"])
async def test_a_statement_cut_off_midway_holds_up_no_later_one(database: str, through: str) -> None:
    """A statement whose task is cancelled leaves its connection mid-statement: closed, not handed
    out again (the next statement is not behind it), through psycopg or on libpq itself (`direct.run`)."""
    pool = DirectPool(database, 1, wait_seconds=2)  # one connection: the next statement gets it back
    sleep = direct.Statement("sleep", "SELECT pg_sleep(%(seconds)s)")
    try:

        async def sleeps() -> None:
            async with pool.connection() as conn:
                if through == "libpq":
                    await direct.run(conn, sleep, {"seconds": "30"})
                else:
                    await conn.execute("SELECT pg_sleep(30)")

        task = asyncio.create_task(sleeps())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        started = time.monotonic()
        await _backend(pool)  # on a connection between statements, not behind the sleep
        assert time.monotonic() - started < 2
    finally:
        await pool.close()


async def test_a_broken_connection_is_an_outage_and_drops_the_idle_ones(
    pool: DirectPool, database: str
) -> None:
    # Two idle connections, both of whose servers go away (as in a Postgres restart).
    async with pool.connection() as one, pool.connection() as two:
        pids = [one.info.backend_pid, two.info.backend_pid]
    for pid in pids:
        await _terminate(database, pid)
    with pytest.raises(psycopg.OperationalError) as raised:
        await _backend(pool)
    assert is_postgres_outage(raised.value)
    # The other idle connection went with the first failure: the next statement succeeds at once.
    assert await _backend(pool) not in pids


async def test_a_connect_that_fails_raises_at_once_as_an_outage() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    pool = DirectPool(f"postgresql://postgres@127.0.0.1:{port}/none", 2, wait_seconds=30)
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError) as raised:
        await _backend(pool)
    assert time.monotonic() - started < 5
    assert is_postgres_outage(raised.value)


async def test_no_connection_free_in_time_is_an_outage(pool: DirectPool) -> None:
    async with pool.connection(), pool.connection():
        with pytest.raises(PoolTimeoutError) as raised:
            await _backend(pool)
    assert is_postgres_outage(raised.value)
    await _backend(pool)  # both back: free again


def test_the_connections_are_split_between_the_engine_and_the_direct_pool() -> None:
    assert shares(20) == (10, 10)
    assert shares(3) == (2, 1)
    assert shares(2) == (1, 1)


def test_a_sqlalchemy_url_names_no_driver_for_psycopg() -> None:
    url = driver_url("postgresql+psycopg://user:secret@db:5433/respool?sslmode=require")
    assert url == "postgresql://user:secret@db:5433/respool?sslmode=require"


_ROW = {
    "owner": "direct",
    "status": "queued",
    "model": "m",
    "background": True,
    "store": True,
    "stream": False,
    "previous_response_id": None,
    "request": {"model": "m", "input": "héllo ☃"},
    "conversation": [{"id": "msg_1", "type": "message", "role": "user", "content": "héllo ☃"}],
    "chain_depth": 0,
    "conversation_id": None,
}


@pytest.mark.parametrize("through", ["direct", "engine"])
async def test_a_response_is_inserted_started_and_finished_through_either_connection(
    pool: DirectPool, database: str, through: str
) -> None:
    response_id = f"resp_direct_{through}"
    row = {**_ROW, "id": response_id, "response": {"id": response_id, "status": "queued"}}
    engine = store.create_engine(database, connections=1)
    try:
        async with pool.connection() as conn:
            await store.insert_response(conn, row, len(row["conversation"]))

        async def run_statements(conn: store.Connection) -> None:
            started = await store.start_attempt(conn, response_id, 2)
            assert started is not None
            assert started.status == "in_progress" and started.response["status"] == "in_progress"
            assert started.request == row["request"] and started.conversation == row["conversation"]
            assert await store.start_attempt(conn, response_id, 2) is None  # the attempt is taken
            final = {"id": response_id, "status": "failed", "error": {"code": "server_error", "message": "x"}}
            assert not await store.mark_finished(conn, response_id, 1, final)  # fenced: a later attempt's
            assert await store.mark_finished(conn, response_id, 2, final)
            assert not await store.mark_finished(conn, response_id, 3, final)  # ended: one outcome

        if through == "direct":
            async with pool.connection() as conn:
                await run_statements(conn)
        else:
            async with engine.begin() as sa:
                await run_statements(sa)
        async with pool.connection() as conn:
            stored = await store.get_response(conn, response_id, "direct")
            assert await store.get_response(conn, response_id, "someone else") is None
        assert stored is not None and stored.status == "failed"
        assert stored.response["error"] == {"code": "server_error", "message": "x"}
        async with engine.connect() as sa:
            assert [item["id"] for item in await store.own_input_items(sa, response_id)] == ["msg_1"]
    finally:
        await engine.dispose()


async def test_a_ticket_tells_what_starting_the_attempt_reads(pool: DirectPool) -> None:
    """A worker holding a response's ticket knows the row as `start_attempt` would read it. A
    ticket over its size bound is not made."""
    response_id = "resp_ticket_started"
    async with pool.connection() as conn:
        row = {**_ROW, "id": response_id, "response": {"id": response_id, "status": "queued", "n": 1.5}}
        await store.insert_response(conn, row, len(row["conversation"]))
        ticket = store.ticket(row, 4096)
        assert ticket is not None and store.ticket(row, len(ticket) - 1) is None
        started = await store.start_attempt(conn, response_id, 3)
        assert started == store.from_ticket(response_id, ticket, 3)


@pytest.mark.parametrize("status", ["in_progress", "queued"])
async def test_an_end_claims_a_row_no_attempt_claimed_and_is_fenced_by_one_that_did(
    pool: DirectPool, status: str
) -> None:
    """A fresh response's first attempt records its end without having claimed its row (the end
    claims it), whether the row says `in_progress` (a foreground one) or `queued` (a background one);
    an attempt's end after a later attempt claimed the row is refused."""
    final = {"status": "completed"}
    unclaimed, taken_over = f"resp_direct_unclaimed_{status}", f"resp_direct_taken_over_{status}"
    async with pool.connection() as conn:
        for response_id in (unclaimed, taken_over):
            row = {**_ROW, "id": response_id, "response": {"id": response_id, "status": status}}
            await store.insert_response(conn, {**row, "status": status}, len(row["conversation"]))
        assert await store.mark_finished(conn, unclaimed, 1, {**final, "id": unclaimed})
        assert await store.start_attempt(conn, unclaimed, 2) is None  # ended: nothing to take over
        assert await store.start_attempt(conn, taken_over, 2) is not None
        assert not await store.mark_finished(conn, taken_over, 1, {**final, "id": taken_over})
        stored = await store.get_response(conn, unclaimed, "direct")
        assert stored is not None and (stored.status, stored.attempt) == ("completed", 1)


async def test_the_apis_read_is_the_response_of_its_owner_stored(pool: DirectPool) -> None:
    """`get_view` (a poll's, a cancel's, a delete's read, without the row's request and input):
    status, background and Response for its owner; nothing for another owner, an unknown id, or a
    response not stored."""
    kept, unkept = f"resp_{uuid.uuid4().hex}", f"resp_{uuid.uuid4().hex}"
    for response_id, stored in ((kept, True), (unkept, False)):
        row = {
            **_ROW,
            "id": response_id,
            "store": stored,
            "response": {"id": response_id, "status": "queued"},
        }
        async with pool.connection() as conn:
            await store.insert_response(conn, row, len(row["conversation"]))
    async with pool.connection() as conn:
        view = await store.get_view(conn, kept, "direct")
        assert view == store.View(Status.QUEUED, True, {"id": kept, "status": "queued"})
        assert await store.get_view(conn, kept, "someone else") is None
        assert await store.get_view(conn, unkept, "direct") is None
        assert await store.get_view(conn, "resp_unknown", "direct") is None


async def test_a_rows_input_items_are_the_last_of_its_conversation(pool: DirectPool, database: str) -> None:
    """A response that continues two items has its own two as its input items, numbered from 0,
    taken from its conversation in the insert; a count past the conversation is refused."""
    response_id = f"resp_{uuid.uuid4().hex}"
    conversation = [
        {"id": f"msg_{name}", "type": "message", "role": "user", "content": name}
        for name in ("earlier", "reply", "own1", "own2")
    ]
    row = {**_ROW, "id": response_id, "conversation": conversation, "response": {"id": response_id}}
    async with pool.connection() as conn:
        with pytest.raises(ValueError, match="5 input items of a conversation of 4"):
            await store.insert_response(conn, row, 5)
        await store.insert_response(conn, row, 2)
        cursor = await conn.execute(
            "SELECT position, item_id FROM input_item WHERE response_id = %s ORDER BY position",
            (response_id,),
        )
        assert await cursor.fetchall() == [(0, "msg_own1"), (1, "msg_own2")]


# The hot statements on libpq itself (`direct.run`) ------------------------------------------------


def test_a_statements_parameters_are_numbered_by_name_in_order_of_first_use() -> None:
    statement = direct.Statement("s", "SELECT %(b)s, %(a)s WHERE %(b)s IS NOT NULL AND 100%%")
    assert (statement.name, statement.parameters) == (b"respool_s", ("b", "a"))
    assert statement.sql == b"SELECT $1, $2 WHERE $1 IS NOT NULL AND 100%%"


def test_parameters_are_sent_in_their_text_form() -> None:
    values = [None, True, False, 0, -12, "héllo", store.Jsonb({"a": [1, "☃"]})]
    texts = [None, b"t", b"f", b"0", b"-12", "héllo".encode(), '{"a":[1,"☃"]}'.encode()]
    assert [direct._text(value) for value in values] == texts
    with pytest.raises(TypeError, match="float"):
        direct._text(1.5)


async def _prepared(conn: psycopg.AsyncConnection[object]) -> list[str]:
    cursor = await conn.execute("SELECT name FROM pg_prepared_statements WHERE name LIKE 'respool%%'")
    return sorted(str(row[0]) for row in await cursor.fetchall())


async def test_a_hot_statement_is_prepared_once_a_connection(pool: DirectPool, database: str) -> None:
    """Prepared on a connection's first use of it, then only executed; a new connection (the old
    one's server gone) prepares it again."""
    async with pool.connection() as conn:
        for _ in range(3):
            await store.get_view(conn, "resp_unknown", "direct")
        assert await _prepared(conn) == ["respool_view"]
        pid = conn.info.backend_pid
    await _terminate(database, pid)
    with pytest.raises(psycopg.OperationalError) as raised:
        async with pool.connection() as conn:
            await store.get_view(conn, "resp_unknown", "direct")
    assert is_postgres_outage(raised.value) and conn.broken
    async with pool.connection() as conn:
        assert conn.info.backend_pid != pid
        assert await store.get_view(conn, "resp_unknown", "direct") is None
        assert await _prepared(conn) == ["respool_view"]


async def test_a_failed_hot_statement_raises_as_psycopg_does_and_its_connection_goes_on(
    pool: DirectPool,
) -> None:
    response_id = f"resp_{uuid.uuid4().hex}"
    row = {**_ROW, "id": response_id, "response": {"id": response_id, "status": "queued"}}
    async with pool.connection() as conn:
        await store.insert_response(conn, row, 1)
        with pytest.raises(psycopg.errors.UniqueViolation):
            await store.insert_response(conn, row, 1)
        view = await store.get_view(conn, response_id, "direct")
        assert view is not None and view.status == Status.QUEUED
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


class _Watching:
    """An event loop that tells which sockets have a reader, and how often one was removed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watched: set[int] = set()
        self.removals = 0

    def add_reader(self, fd: int, callback: Callable[..., object], *args: Any) -> None:
        super().add_reader(fd, callback, *args)  # type: ignore[misc]
        self.watched.add(fd)

    def remove_reader(self, fd: int) -> bool:
        self.removals += 1
        self.watched.discard(fd)
        return bool(super().remove_reader(fd))  # type: ignore[misc]


class _WatchingUvloop(_Watching, uvloop.Loop):
    pass


class _WatchingAsyncio(_Watching, asyncio.SelectorEventLoop):
    pass


def _on(loop_kind: str, check: Callable[[_Watching], Coroutine[Any, Any, None]]) -> None:
    """`check` run on a fresh event loop of that kind: uvloop's, as the API and the worker run, or
    asyncio's own."""
    loop = _WatchingUvloop() if loop_kind == "uvloop" else _WatchingAsyncio()
    try:
        loop.run_until_complete(check(loop))
    finally:
        loop.close()


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_a_connections_socket_stays_watched_between_hot_statements(database: str, loop_kind: str) -> None:
    """One watch of its socket for a connection's life, not one added and removed around each
    reply (on uvloop eight system calls a statement); psycopg's own wait on the same socket in
    between takes it away, and the next hot statement watches it again; a closed connection is
    no longer watched (the kernel hands its socket's number out again)."""

    async def check(loop: _Watching) -> None:
        pool = DirectPool(database, 1)
        try:
            async with pool.connection() as conn:
                fd = conn.pgconn.socket
                assert await store.get_view(conn, "resp_unknown", "direct") is None
                removals = loop.removals
                for _ in range(3):
                    assert await store.get_view(conn, "resp_unknown", "direct") is None
                assert loop.removals == removals and fd in loop.watched
                await conn.execute("SELECT 1")  # psycopg's own wait: adds its reader, removes it
                assert fd not in loop.watched
                assert await store.get_view(conn, "resp_unknown", "direct") is None
            assert fd in loop.watched  # watched while it waits in the pool
        finally:
            await pool.close()
        assert fd not in loop.watched

    _on(loop_kind, check)


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_a_watched_idle_connection_whose_server_goes_is_unwatched(database: str, loop_kind: str) -> None:
    """The server closing an idle connection makes its socket readable with nobody waiting: what
    came is read (a level-triggered poll would call again at once, for ever) and, the connection
    broken, its watch goes; the next statement on it is an outage, and the one after succeeds."""

    async def check(loop: _Watching) -> None:
        pool = DirectPool(database, 1)
        try:
            async with pool.connection() as conn:
                assert await store.get_view(conn, "resp_unknown", "direct") is None
                fd, pid = conn.pgconn.socket, conn.info.backend_pid
            assert fd in loop.watched
            await _terminate(database, pid)
            deadline = time.monotonic() + 5
            # the watch reads the server's goodbye (libpq tells it by the connection's status alone)
            while conn.pgconn.status == psycopg.pq.ConnStatus.OK and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            assert conn.pgconn.status == psycopg.pq.ConnStatus.BAD
            assert fd not in loop.watched
            with pytest.raises(psycopg.OperationalError) as raised:
                async with pool.connection() as same:
                    await store.get_view(same, "resp_unknown", "direct")
            assert is_postgres_outage(raised.value)
            async with pool.connection() as fresh:
                assert fresh.info.backend_pid != pid
                assert await store.get_view(fresh, "resp_unknown", "direct") is None
        finally:
            await pool.close()

    _on(loop_kind, check)
