"""Single statements on psycopg directly, from a pool of its own: the hot path's; the
hottest of them on libpq itself (`Statement`, `run`).

A response costs a few one-statement round trips to Postgres (the API's insert, the worker's start
of an attempt and its final record, each poll's read). Through SQLAlchemy's asyncio engine each
cost ~3x its own CPU: the checkout (greenlet hop, the AUTOCOMMIT isolation set and reset, pool
events) and the execution context around the driver's call (measured here, one statement in a
loop: 700-800 µs of CPU through the engine, 230 on psycopg directly). Transactions of several
statements (conversations, webhooks, the sweep) stay on the engine (worker/postgres/store.py).

The pool is respool's, not psycopg_pool's, for the outage rule (worker/outages.py): a connect that
fails raises at once, so the API answers 503 and the worker retries `patiently`; psycopg_pool's
getconn waits out its timeout while a background task reconnects. As the engine does, a checkout
does not ping first: after a Postgres restart the first statement on a broken connection fails as
unreachable, and every idle connection is dropped with it (the engine "invalidates" its pool).

Every wait on Postgres has a deadline of the client's own (`Connection`): a server that is stopped
or whose host went silent answers nothing, and its `statement_timeout` never fires. A statement past
its deadline closes its connection (it may be mid-protocol) and raises `StatementTimeoutError`, an
outage. Behind a transaction pooler (`RESPOOL_DATABASE_POOLER=transaction`, docs/postgres.md) no
statement is prepared: a prepared statement lives on one server connection, and the pooler hands the
next transaction another.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson
import psycopg
from psycopg import pq
from psycopg.abc import PQGen
from psycopg.errors import _WaitTimeout, error_from_result
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads
from sqlalchemy.engine import make_url

# How often psycopg's own waits look at the socket again (its default).
_WAIT_INTERVAL = 0.1


class PoolTimeoutError(psycopg.OperationalError):
    """No connection came free in time: every one is busy (overload) or hangs."""


class StatementTimeoutError(psycopg.OperationalError):
    """Postgres answered nothing within the client's deadline: stopped, its host silent, or far
    behind. The connection is closed (it may be mid-protocol); the statement may have run."""


class Connection(psycopg.AsyncConnection[Any]):
    """psycopg's async connection, each wait on Postgres (a statement, a commit) bounded by
    `deadline_seconds`, and whether the hot statements are prepared on it (`is_preparing`)."""

    deadline_seconds: float | None = None
    is_preparing: bool = True

    async def wait[RV](
        self,
        gen: PQGen[RV],
        interval: float = _WAIT_INTERVAL,
        timeout: float | None = None,  # noqa: ASYNC109  # psycopg's signature, overridden
    ) -> RV:
        deadline = self.deadline_seconds
        if deadline is None or (timeout is not None and timeout <= deadline):
            return await super().wait(gen, interval, timeout)
        # psycopg's own timeout, not a cancellation: a cancelled wait asks the server to cancel the
        # statement and waits for its answer, twice 5 s more from a server that answers nothing.
        try:
            return await super().wait(gen, interval, deadline)
        except _WaitTimeout:
            self.discard()
            raise StatementTimeoutError(f"Postgres did not answer within {deadline:g} s") from None

    def discard(self) -> None:
        """Close the connection at once, without a word to the server (it may not answer)."""
        state = _states.pop(self.pgconn, None)
        if state is not None:
            state.unwatch()
        self.pgconn.finish()


async def connect(
    conninfo: str = "", *, deadline_seconds: float | None = None, is_preparing: bool = True, **kwargs: Any
) -> Connection:
    """A `Connection` to `conninfo` and `kwargs` (psycopg's connect's, as SQLAlchemy passes them);
    psycopg prepares none of its statements unless `is_preparing` (it prepares a query run 5 times
    on a connection, as respool's hot statements are)."""
    conn = await Connection.connect(conninfo, prepare_threshold=5 if is_preparing else None, **kwargs)
    conn.deadline_seconds, conn.is_preparing = deadline_seconds, is_preparing
    return conn


class DirectPool:
    """Up to `connections` autocommit psycopg connections, each kept once opened (as the engine's)."""

    def __init__(
        self,
        database_url: str,
        connections: int,
        *,
        connect_timeout_seconds: int = 5,
        wait_seconds: float = 30.0,
        deadline_seconds: float | None = None,
        is_preparing: bool = True,
    ) -> None:
        self._conninfo = driver_url(database_url)
        self._connect_timeout = connect_timeout_seconds
        self._wait_seconds = wait_seconds
        self._deadline_seconds = deadline_seconds
        self._is_preparing = is_preparing
        self._free = asyncio.Semaphore(connections)
        self._idle: list[Connection] = []
        self._closed = False

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Connection]:
        """A connection for one statement or a few (each its own transaction)."""
        try:
            if self._free.locked():  # none free: waited for, bounded (a free one is taken at once)
                async with asyncio.timeout(self._wait_seconds):
                    await self._free.acquire()
            else:
                await self._free.acquire()
        except TimeoutError:
            raise PoolTimeoutError(
                f"no Postgres connection came free within {self._wait_seconds:g} s"
            ) from None
        try:
            conn = self._idle.pop() if self._idle else await self._connect()
            try:
                yield conn
            except psycopg.OperationalError:
                if conn.broken:  # Postgres went away: so did every idle connection's server
                    await self._drop_idle()
                raise
            finally:
                await self._put_back(conn)
        finally:
            self._free.release()

    async def close(self) -> None:
        self._closed = True
        await self._drop_idle()

    async def ping(self, seconds: float) -> None:
        """Raise an outage unless Postgres answers a statement within `seconds` (`/readyz`), a
        connect included."""
        try:
            async with asyncio.timeout(seconds), self.connection() as conn:
                await run(conn, _PING, {})
        except TimeoutError:
            raise StatementTimeoutError(f"Postgres did not answer within {seconds:g} s") from None

    async def _connect(self) -> Connection:
        conn = await connect(
            self._conninfo,
            deadline_seconds=self._deadline_seconds,
            is_preparing=self._is_preparing,
            autocommit=True,
            connect_timeout=self._connect_timeout,
        )
        # JSON through orjson, as the engine's connections (store.create_engine).
        set_json_loads(orjson.loads, conn)
        set_json_dumps(orjson.dumps, conn)
        return conn

    async def _put_back(self, conn: Connection) -> None:
        """Keep a connection that is between statements; close any other (broken, or a statement
        cut off mid-way: its task was cancelled)."""
        usable = not (conn.closed or conn.broken or self._closed)
        if usable and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            self._idle.append(conn)
        else:
            await _close(conn)

    async def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await _close(conn)


async def _close(conn: Connection) -> None:
    """Close `conn`, its socket unwatched first (`_Libpq.unwatch`): a socket number the kernel
    hands out again must not find this one's watch."""
    state = _states.pop(conn.pgconn, None)
    if state is not None:
        state.unwatch()
    await conn.close()


def shares(connections: int) -> tuple[int, int]:
    """A process's `connections` (RESPOOL_DATABASE_CONNECTIONS, at least 2) split between the
    engine (transactions) and the direct pool (single statements): half each."""
    direct = connections // 2
    return connections - direct, direct


def driver_url(database_url: str) -> str:
    """A URL psycopg connects to: `postgresql+psycopg://…` (SQLAlchemy's form) without its driver."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)


# Hot statements on libpq itself --------------------------------------------------------------------


class Statement:
    """A hot statement (the API's insert and reads, the worker's end), prepared once on each
    connection of a `DirectPool` and run on libpq itself (`psycopg.pq`), its parameters sent as
    text: psycopg's cursor around the same prepared statement (its query conversion, its dumpers,
    its generators) cost ~100 µs of CPU a statement more (222 against 122 µs, an UPDATE of a 1 KB
    jsonb in a loop on this project's bench machine). Written as psycopg's SQL (`%(name)s`), so a
    statement in an engine's transaction runs the same SQL through psycopg (`run` is for
    autocommit connections only: psycopg opens a transaction's BEGIN lazily, before its cursor's
    first statement, which this path does not send)."""

    __slots__ = ("name", "parameters", "sql")

    def __init__(self, name: str, sql: str) -> None:
        names: list[str] = []

        def numbered(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        self.name = f"respool_{name}".encode()
        self.sql = re.sub(r"%\((\w+)\)s", numbered, sql).encode()
        self.parameters = tuple(names)


class _Libpq:
    """What `run` keeps of one connection: the statements it has prepared (psycopg's own are named
    `_pg3_<n>`, never these), and its socket's watch.

    The socket stays watched by the event loop between statements, one callback for its life, not
    added before each reply and removed after: uvloop makes a poll handle for each `add_reader` of
    a socket it does not watch and closes it at its `remove_reader`, eight system calls a statement
    (epoll_ctl six times, three of them failing, an ioctl, an io_uring_enter; counted with strace),
    each dear on a virtual machine. Input nobody waits for (the server closing the connection, a
    notice) is read into libpq's buffer, as the loop's poll is level-triggered; a connection it
    breaks is unwatched.
    psycopg's own waits on the same socket (a statement through its cursor) replace the callback
    and remove it at their end: `wait` adds it again (free while it is there)."""

    __slots__ = ("fd", "loop", "pgconn", "prepared", "waiter")

    def __init__(self, pgconn: pq.abc.PGconn) -> None:
        self.pgconn = pgconn
        self.prepared: set[bytes] = set()
        self.fd = -1
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waiter: asyncio.Future[None] | None = None

    async def wait(self, until: float | None) -> None:
        """Until the socket is readable; TimeoutError at loop time `until`, if it is not by then (a
        timer, not `asyncio.timeout`, which costs several times its CPU: docs/postgres.md)."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:  # its first wait (or one on another loop: the old watch goes)
            self.unwatch()
            self.fd, self.loop = self.pgconn.socket, loop
        waiter = self.waiter = loop.create_future()
        loop.add_reader(self.fd, self._readable)
        timer = None if until is None else loop.call_at(until, self._expire)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def _expire(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())

    def _readable(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)
            return
        try:  # nobody waits: read it, or a level-triggered poll calls again at once
            self.pgconn.consume_input()
        except psycopg.OperationalError:  # the server closed it: the next statement finds it broken
            self.unwatch()

    def unwatch(self) -> None:
        loop, self.loop = self.loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.fd)


_states: weakref.WeakKeyDictionary[pq.abc.PGconn, _Libpq] = weakref.WeakKeyDictionary()
_PING = Statement("ping", "SELECT 1")


async def run(conn: Connection, statement: Statement, parameters: Mapping[str, Any]) -> pq.abc.PGresult:
    """Run `statement` on `conn` (autocommit, held by the caller alone) with `parameters` by name;
    its result. A failed statement raises as psycopg raises it (`psycopg.errors`), a connection
    that broke `psycopg.OperationalError` (the connection then `broken`)."""
    pgconn = conn.pgconn
    state = _states.get(pgconn)
    if state is None:
        state = _states[pgconn] = _Libpq(pgconn)
    values = [_text(parameters[name]) for name in statement.parameters]
    # Any psycopg connection serves: one that `connect` did not make has no deadline, and prepares.
    deadline: float | None = getattr(conn, "deadline_seconds", None)
    until = None if deadline is None else asyncio.get_running_loop().time() + deadline
    try:
        if not getattr(conn, "is_preparing", True):  # the unnamed statement: parsed and planned each time
            pgconn.send_query_params(statement.sql, values)
            return await _result(state, until)
        if statement.name not in state.prepared:
            pgconn.send_prepare(statement.name, statement.sql)
            await _result(state, until)
            state.prepared.add(statement.name)
        pgconn.send_query_prepared(statement.name, values)
        return await _result(state, until)
    except TimeoutError:
        conn.discard()
        raise StatementTimeoutError(f"Postgres did not answer within {deadline:g} s") from None


def _text(value: Any) -> bytes | None:
    """A parameter in Postgres's text form (its type is the statement's, as Postgres infers it)."""
    if value is None:
        return None
    if value is True or value is False:
        return b"t" if value else b"f"
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int):
        return b"%d" % value
    if isinstance(value, Jsonb):
        return orjson.dumps(value.obj)
    raise TypeError(f"no text form for a parameter of type {type(value).__name__}")


async def _result(state: _Libpq, until: float | None) -> pq.abc.PGresult:
    """The result of the statement just sent (its rest flushed first), once all of it has come;
    TimeoutError if it has not by loop time `until`."""
    pgconn = state.pgconn
    while pgconn.flush():  # non-blocking: what the socket did not take waits for it to drain
        async with asyncio.timeout_at(until):
            await _writable(pgconn.socket)
    result = None
    while True:
        while pgconn.is_busy():
            await state.wait(until)
            pgconn.consume_input()
        got = pgconn.get_result()
        if got is None:
            break
        result = got
    if result is None:
        raise psycopg.OperationalError("the statement got no result")
    if result.status == pq.ExecStatus.FATAL_ERROR:
        raise error_from_result(result, encoding="utf-8")
    return result


async def _writable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    loop.add_writer(fd, _wake, waiter)
    try:
        await waiter
    finally:
        loop.remove_writer(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
