"""Single statements on psycopg directly, from a pool of its own: the hot path's (issue 20).

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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import psycopg
from psycopg.types.json import set_json_dumps, set_json_loads
from sqlalchemy.engine import make_url

type Connection = psycopg.AsyncConnection[Any]


class PoolTimeoutError(psycopg.OperationalError):
    """No connection came free in time: every one is busy (overload) or hangs."""


class DirectPool:
    """Up to `connections` autocommit psycopg connections, each kept once opened (as the engine's)."""

    def __init__(
        self,
        database_url: str,
        connections: int,
        *,
        connect_timeout_seconds: int = 5,
        wait_seconds: float = 30.0,
    ) -> None:
        self._conninfo = driver_url(database_url)
        self._connect_timeout = connect_timeout_seconds
        self._wait_seconds = wait_seconds
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

    async def _connect(self) -> Connection:
        conn = await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, connect_timeout=self._connect_timeout
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
            await conn.close()

    async def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()


def shares(connections: int) -> tuple[int, int]:
    """A process's `connections` (RESPOOL_DATABASE_CONNECTIONS, at least 2) split between the
    engine (transactions) and the direct pool (single statements): half each."""
    direct = connections // 2
    return connections - direct, direct


def driver_url(database_url: str) -> str:
    """A URL psycopg connects to: `postgresql+psycopg://…` (SQLAlchemy's form) without its driver."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
