"""Every Redis client respool builds, in one place: each process's pooled asyncio client, a relay's
blocking client, and RQ's synchronous one. Postgres engines are the store's (`worker.postgres.store`).

A `redis+sentinel://` URL (docs/redis.md) makes each of them a client of the primary that the
sentinels name, found again whenever a connection is made; every other URL is redis-py's own.

Nothing connects here: a client connects on its first command.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from typing import Any

import hiredis
from redis import Redis as SyncRedis
from redis.asyncio import BlockingConnectionPool, Connection, ConnectionPool, Redis, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.sentinel import async_pool, is_role_change, sentinel_address, sync_pool


def _pool(
    redis_url: str, pool_class: type[ConnectionPool], timeout_seconds: float, **kwargs: Any
) -> ConnectionPool:
    address = sentinel_address(redis_url)
    if address is None:
        return pool_class.from_url(redis_url, **kwargs)
    return async_pool(address, timeout_seconds, is_blocking=pool_class is BlockingConnectionPool, **kwargs)


def connect(redis_url: str, max_connections: int, timeout_seconds: float = 5.0) -> Redis:
    """A client whose pool makes a burst wait for a free connection instead of failing, and whose
    every connect and reply gives up after `timeout_seconds`: a hung Redis is an error, not a hang.
    So never a blocking read (XREAD BLOCK) longer than that: such a read needs `blocking_client`.

    A command that meets a dropped connection is sent once more on a new one: after Redis restarts,
    each pooled connection fails its next command (a timeout is not retried: Redis may have run it).
    Behind Sentinel, a server that is no longer the primary counts as a dropped connection: the
    command is sent once more to the primary the sentinels name.
    """
    pool = _pool(
        redis_url,
        BlockingConnectionPool,
        timeout_seconds,
        max_connections=max_connections,
        timeout=30,
        socket_connect_timeout=timeout_seconds,
        socket_timeout=timeout_seconds,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return Redis(connection_pool=hiredis_packing(pool))


def blocking_client(redis_url: str, block_seconds: float, timeout_seconds: float) -> Redis:
    """One connection for reads that block up to `block_seconds` (the tailer's XREAD): its read
    timeout is that plus `timeout_seconds` (a shorter one would cut every idle read short)."""
    pool = _pool(
        redis_url,
        ConnectionPool,
        timeout_seconds,
        max_connections=1,
        socket_connect_timeout=timeout_seconds,
        socket_timeout=block_seconds + timeout_seconds,
    )
    return Redis.from_pool(hiredis_packing(pool))  # its own pool: closing the client closes it


def sync_client(redis_url: str, timeout_seconds: float | None = None) -> SyncRedis:
    """RQ's synchronous client (its queue, registries and worker loop); `timeout_seconds` bounds each
    connect and reply (None: RQ's own blocking pops need no bound)."""
    address = sentinel_address(redis_url)
    if address is None:
        return SyncRedis.from_url(
            redis_url, socket_connect_timeout=timeout_seconds, socket_timeout=timeout_seconds
        )
    pool = sync_pool(
        address, timeout_seconds, socket_connect_timeout=timeout_seconds, socket_timeout=timeout_seconds
    )
    return SyncRedis(connection_pool=pool)


async def bare_command(redis: Redis, *args: str | bytes | int | float) -> Any:
    """One command on a connection of `redis`'s pool, its reply as Redis sent it (hiredis's parse;
    no response callback): for the hot paths' commands (the worker's appends, the tailer's reads),
    on which the client's per-command machinery (retry wrapper, observability hooks, timeouts, its
    packing) cost about twice the round trip's own CPU: 200 µs against 76 for an XREAD of 31
    streams, on this project's bench machine.

    As `connect`'s clients do, a command that meets a dropped connection is sent once more on a new
    one (a timeout is not retried: Redis may have run it); an error reply is raised as redis-py
    raises it (`NoScriptError`, `ResponseError`); a connection left mid-reply is closed.
    """
    (reply,) = await bare_pipeline(redis, args)
    if isinstance(reply, ResponseError):
        raise reply
    return reply


async def bare_pipeline(redis: Redis, *commands: tuple[str | bytes | int | float, ...]) -> list[Any]:
    """`commands` sent in one write on one connection of `redis`'s pool, their replies as Redis sent
    them, in order (as `bare_command` does for one); an error reply is its exception in the list."""
    packed = b"".join(hiredis.pack_command(command) for command in commands)  # type: ignore[arg-type]
    pool = redis.connection_pool
    for tries_left in (1, 0):
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            await connection.send_packed_command(packed, check_health=False)
            return [await _reply(connection) for _ in commands]
        except RedisConnectionError:
            await connection.disconnect()
            if not tries_left:
                raise
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            await pool.release(connection)
    raise AssertionError("unreachable")


class HeldConnection:
    """One connection of `redis`'s pool, taken once and held by a user whose round trips go one at
    a time (the worker's appends, the tailer's reads): its commands are written
    and their replies read on the connection's own stream and parser, without the pool's checkout
    and the client's per-command timeouts and hooks. A round trip of one GET cost 36 to 42 µs of CPU
    so, 135 to 168 through `bare_command` (the same loop, this project's bench machine).

    As `bare_pipeline`: commands go in one write, their replies come as Redis sent them (an error
    reply is its exception in the list), and a dropped connection is replaced and the commands sent
    once more on the new one. A round trip that outlasts the connection's socket timeout (the pool's:
    a blocking client's allows for its blocks) closes the connection and raises `TimeoutError`, not
    retried (Redis may have run it); one cancelled mid-reply closes the connection too.
    """

    def __init__(self, redis: Redis) -> None:
        self._pool = redis.connection_pool
        self._follows_primary = isinstance(self._pool, SentinelConnectionPool)
        self._connection: Any = None
        self._busy = False
        self._timed_out = False

    async def command(self, *args: str | bytes | int | float) -> Any:
        """One command, its reply (an error reply raised, as `bare_command` does)."""
        (reply,) = await self.pipeline(args)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def pipeline(self, *commands: tuple[str | bytes | int | float, ...]) -> list[Any]:
        if self._busy:  # two round trips at once would read each other's replies
            raise RuntimeError("a held connection's round trips go one at a time")
        self._busy = True
        try:
            packed = b"".join(hiredis.pack_command(command) for command in commands)  # type: ignore[arg-type]
            for tries_left in (1, 0):
                try:
                    return await self._round_trip(packed, len(commands))
                except (RedisConnectionError, OSError) as exc:
                    await self._drop()
                    if self._timed_out:
                        self._timed_out = False
                        raise RedisTimeoutError("Timeout reading from Redis") from exc
                    if not tries_left:
                        raise RedisConnectionError(str(exc)) from exc
                except BaseException:
                    await self._drop()  # left mid-reply: unfit for the next round trip
                    raise
            raise AssertionError("unreachable")
        finally:
            self._busy = False

    async def _round_trip(self, packed: bytes, count: int) -> list[Any]:
        self._timed_out = False  # an earlier timer that fired as its reply came says nothing of this one
        connection = self._connection
        if connection is None:
            connection = self._connection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        if not connection.is_connected:  # the pool disconnected it (a reset), or it never connected
            await connection.connect()
        writer = connection._writer
        writer.write(packed)
        await writer.drain()
        timeout = connection.socket_timeout
        timer = None if not timeout else asyncio.get_running_loop().call_later(timeout, self._expire, writer)
        try:
            parser = connection._parser
            replies = [await _parsed(parser) for _ in range(count)]
        finally:
            if timer is not None:
                timer.cancel()
        if self._follows_primary and any(is_role_change(reply) for reply in replies):
            # what `_PrimaryConnection` does for the pool's own reads, which this one bypasses
            raise RedisConnectionError(f"{connection.host}:{connection.port} is no longer the primary")
        return replies

    def _expire(self, writer: asyncio.StreamWriter) -> None:
        """The reply is overdue: close the connection under the read, which then fails."""
        self._timed_out = True
        writer.transport.abort()

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.disconnect(nowait=True)
            await self._pool.release(connection)

    async def close(self) -> None:
        """Give the connection back to the pool."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._pool.release(connection)


class HeldConnections:
    """Up to `most` held connections (`HeldConnection`) of `redis`'s pool, each lent to one caller
    for a round trip: a hot path's commands (a create's enqueue, a relay's wake-up, a response's end)
    without the pool's checkout and the client's per-command timeouts and hooks around each (a GET's
    round trip cost 60 to 67 µs of CPU so, 131 to 145 through `bare_command`, measured in a loop on
    this project's bench machine, 2026-11-28). While all are lent, a command goes through
    `bare_command`: no caller waits for one. Replies and failures are as `bare_command`'s."""

    def __init__(self, redis: Redis, most: int) -> None:
        self._redis = redis
        self._idle: list[HeldConnection] = []
        self._room = most  # how many more may be made

    async def command(self, *args: str | bytes | int | float) -> Any:
        held = self._lend()
        if held is None:
            return await bare_command(self._redis, *args)
        try:
            return await held.command(*args)
        finally:
            self._idle.append(held)

    def _lend(self) -> HeldConnection | None:
        if self._idle:
            return self._idle.pop()
        if self._room:
            self._room -= 1
            return HeldConnection(self._redis)
        return None

    async def close(self) -> None:
        """Give the idle ones' connections back to the pool (a lent one's goes with the pool's close)."""
        idle, self._idle = self._idle, []
        for held in idle:
            await held.close()


async def _parsed(parser: Any) -> Any:
    try:
        return await parser.read_response()
    except ResponseError as exc:
        return exc


async def _reply(connection: Any) -> Any:
    try:
        return await connection.read_response()
    except ResponseError as exc:  # the whole reply was read: the connection is fit for the next one
        return exc


class _HiredisPacking:
    """Commands packed by hiredis (C), as redis-py's sync client already does; its asyncio client
    packs them in Python, which was a tenth of a worker's CPU under streaming load (py-spy)."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        packed: list[bytes] = self._packer.pack(*args)
        return packed


class _ResolvedFirst:
    """A TCP (or TLS) connection whose host name is resolved by the loop's `getaddrinfo` before it
    connects, then connected to address by address. uvloop's `create_connection` resolves a name
    itself and, cancelled meanwhile (redis-py's connect timeout, while a slow or failing DNS cannot
    find Redis, or its container's name, during an outage), leaves its resolution's future to fail
    unseen: the loop then logs "Future exception was never retrieved" (MagicStack/uvloop#437). To a
    numeric address it connects without resolving anything; a cancelled `getaddrinfo` leaves
    nothing behind."""

    host: str
    port: int
    socket_connect_timeout: float | None
    _address: str | None = None  # the one being tried, while `_connect` runs

    def _connection_arguments(self) -> Mapping[str, Any]:
        arguments = dict(super()._connection_arguments())  # type: ignore[misc]
        if self._address is not None:
            if arguments.get("ssl") is not None:
                arguments["server_hostname"] = self.host  # TLS checks the name, not the address
            arguments["host"] = self._address
        return arguments

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.socket_connect_timeout):
            found = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        failures: list[OSError] = []
        for *_, address in found:
            self._address = str(address[0])
            try:
                await super()._connect()  # type: ignore[misc]
            except OSError as exc:  # refused on this address: the next one may answer
                failures.append(exc)
                continue
            finally:
                self._address = None
            return
        raise failures[0] if failures else OSError(f"no address found for {self.host}")


def hiredis_packing[Pool: ConnectionPool](pool: Pool) -> Pool:
    """`pool`, its connections (TCP, Unix socket or TLS, as its URL said) packing with hiredis, a
    TCP one's host name resolved before it connects (`_ResolvedFirst`)."""
    base = pool.connection_class
    if not issubclass(base, _HiredisPacking):
        if base in (Connection, SSLConnection):  # TCP, TLS; Sentinel's finds its own address
            base = type(base.__name__, (_ResolvedFirst, base), {})
        pool.connection_class = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
    return pool
