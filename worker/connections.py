"""Every Redis client respool builds, in one place: each process's pooled asyncio client, a relay's
blocking client, and RQ's synchronous one. Postgres engines are the store's (`worker.postgres.store`).

Nothing connects here: a client connects on its first command.
"""

from __future__ import annotations

from typing import Any

import hiredis
from redis import Redis as SyncRedis
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError


def connect(redis_url: str, max_connections: int, timeout_seconds: float = 5.0) -> Redis:
    """A client whose pool makes a burst wait for a free connection instead of failing, and whose
    every connect and reply gives up after `timeout_seconds`: a hung Redis is an error, not a hang.
    So never a blocking read (XREAD BLOCK) longer than that: such a read needs `blocking_client`.

    A command that meets a dropped connection is sent once more on a new one: after Redis restarts,
    each pooled connection fails its next command (a timeout is not retried: Redis may have run it).
    """
    pool = BlockingConnectionPool.from_url(
        redis_url,
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
    client = Redis.from_url(
        redis_url,
        max_connections=1,
        socket_connect_timeout=timeout_seconds,
        socket_timeout=block_seconds + timeout_seconds,
    )
    hiredis_packing(client.connection_pool)
    return client


def sync_client(redis_url: str, timeout_seconds: float | None = None) -> SyncRedis:
    """RQ's synchronous client (its queue, registries and worker loop); `timeout_seconds` bounds each
    connect and reply (None: RQ's own blocking pops need no bound)."""
    return SyncRedis.from_url(
        redis_url, socket_connect_timeout=timeout_seconds, socket_timeout=timeout_seconds
    )


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


def hiredis_packing[Pool: ConnectionPool](pool: Pool) -> Pool:
    """`pool`, its connections (TCP, Unix socket or TLS, as its URL said) packing with hiredis."""
    base = pool.connection_class
    if not issubclass(base, _HiredisPacking):
        pool.connection_class = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
    return pool
