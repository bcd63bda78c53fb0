"""`bare_command` and `HeldConnection`, the hot paths' ways to send commands (worker/connections.py),
on real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.support.stack import Servers
from worker.connections import HeldConnection, HeldConnections, bare_command, connect

pytestmark = pytest.mark.integration


@pytest.fixture
async def one(backing: Servers) -> AsyncIterator[Redis]:
    """A client whose pool holds a single connection: every command meets the one before's."""
    client = connect(backing.redis_url, max_connections=1)
    yield client
    await client.aclose()
    await client.connection_pool.disconnect()


async def test_a_reply_comes_as_redis_sent_it(redis: Redis) -> None:
    await redis.delete("bare:s")
    await redis.xadd("bare:s", {"t": "a", "d": "{}"}, id="0-1")
    reply = await bare_command(redis, "XREAD", "STREAMS", "bare:s", "0-0")
    # RESP3 sends a map of stream to entries, RESP2 a list of pairs; each entry's fields stay a flat
    # list either way (redis-py's own parsing would make a dict of each).
    streams = [list(pair) for pair in (reply.items() if isinstance(reply, dict) else reply)]
    assert streams == [[b"bare:s", [[b"0-1", [b"t", b"a", b"d", b"{}"]]]]]
    assert await bare_command(redis, "GET", "bare:none") is None
    await redis.delete("bare:s")


async def test_an_error_reply_is_raised_and_the_connection_serves_the_next_command(one: Redis) -> None:
    connection = await bare_command(one, "CLIENT", "ID")
    with pytest.raises(NoScriptError):
        await bare_command(one, "EVALSHA", "0" * 40, 0)
    with pytest.raises(ResponseError, match="wrong number of arguments"):
        await bare_command(one, "GET")
    assert await bare_command(one, "CLIENT", "ID") == connection  # kept: the replies were whole


async def test_a_dropped_connection_is_replaced_and_the_command_sent_once_more(
    one: Redis, redis: Redis
) -> None:
    first = await bare_command(one, "CLIENT", "ID")
    await redis.execute_command("CLIENT", "KILL", "ID", first)
    await bare_command(one, "SET", "bare:k", "v")  # meets the dead connection, goes again on a new one
    assert await redis.get("bare:k") == b"v"
    assert await bare_command(one, "CLIENT", "ID") != first
    await redis.delete("bare:k")


@pytest.fixture(params=["bare", "held", "lent"])
async def send(request: pytest.FixtureRequest, one: Redis) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """One command's way on `one`'s single connection: `bare_command`, a `HeldConnection`, or one
    lent by `HeldConnections`."""
    if request.param == "bare":
        yield partial(bare_command, one)
        return
    held = HeldConnection(one) if request.param == "held" else HeldConnections(one, 1)
    yield held.command
    await held.close()


async def test_a_command_cancelled_before_its_reply_leaves_no_reply_behind(
    send: Callable[..., Awaitable[Any]], redis: Redis
) -> None:
    """The reply of a cancelled command must not answer the next one: its connection is closed."""
    await redis.delete("bare:list")
    blocked = await send("CLIENT", "ID")
    waiting = asyncio.create_task(send("BLPOP", "bare:list", 5))
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await _closed(redis, blocked, "the cancelled command's connection was kept open")
    await redis.rpush("bare:list", "late")  # no one blocks on it any more
    assert await send("ECHO", "next") == b"next"
    assert await redis.lpop("bare:list") == b"late"


async def _closed(redis: Redis, client_id: int, failure: str) -> None:
    """Wait until Redis no longer lists the client: it notices a close on its own time, and until
    then a blocked command of that client would still take what comes."""
    for _ in range(250):
        if not await redis.execute_command("CLIENT", "LIST", "ID", client_id):
            return
        await asyncio.sleep(0.02)
    pytest.fail(failure)


# HeldConnection ----------------------------------------------------------------------------------


@pytest.fixture
async def held(one: Redis) -> AsyncIterator[HeldConnection]:
    connection = HeldConnection(one)
    yield connection
    await connection.close()


async def test_a_held_connection_answers_each_command_of_a_round_trip_in_order(
    held: HeldConnection, redis: Redis
) -> None:
    await redis.delete("held:k")
    replies = await held.pipeline(("SET", "held:k", "v"), ("GET", "held:k"), ("GET",), ("GET", "held:none"))
    assert replies[:2] == [True, b"v"] or replies[:2] == [b"OK", b"v"]
    assert isinstance(replies[2], ResponseError)  # an error reply is its exception in the list
    assert replies[3] is None
    with pytest.raises(NoScriptError):
        await held.command("EVALSHA", "0" * 40, 0)
    assert await held.command("ECHO", "still") == b"still"  # the replies were whole: kept
    await redis.delete("held:k")


async def test_a_held_connection_is_one_connection_kept_across_round_trips(held: HeldConnection) -> None:
    first = await held.command("CLIENT", "ID")
    for _ in range(3):
        assert await held.command("CLIENT", "ID") == first


async def test_a_held_connection_dropped_is_replaced_and_the_commands_sent_once_more(
    held: HeldConnection, redis: Redis
) -> None:
    first = await held.command("CLIENT", "ID")
    await redis.execute_command("CLIENT", "KILL", "ID", first)
    await held.command("SET", "held:k", "again")  # meets the dead connection, goes again on a new one
    assert await redis.get("held:k") == b"again"
    assert await held.command("CLIENT", "ID") != first
    await redis.delete("held:k")


async def test_a_held_connection_whose_reply_is_overdue_times_out_without_sending_again(
    backing: Servers, redis: Redis
) -> None:
    """Past the pool's socket timeout the read fails (Redis may have run the command: it is not sent
    again) and the connection is closed; the next round trip goes on a new one."""
    await redis.delete("held:list")
    client = connect(backing.redis_url, max_connections=1, timeout_seconds=0.3)
    held = HeldConnection(client)
    try:
        first = await held.command("CLIENT", "ID")
        with pytest.raises(RedisTimeoutError):
            await held.command("BLPOP", "held:list", 2)
        assert await held.command("CLIENT", "ID") != first
        await _closed(redis, first, "the overdue command's connection was kept open")
    finally:
        await held.close()
        await client.aclose()
        await client.connection_pool.disconnect()


async def test_a_held_connection_refuses_a_second_round_trip_at_once(
    held: HeldConnection, redis: Redis
) -> None:
    await redis.delete("held:list")
    waiting = asyncio.create_task(held.command("BLPOP", "held:list", 1))
    await asyncio.sleep(0.1)
    with pytest.raises(RuntimeError, match="one at a time"):
        await held.command("ECHO", "no")
    assert await waiting is None  # the first one's reply was its own
    assert await held.command("ECHO", "yes") == b"yes"


async def test_a_held_connection_that_its_pool_disconnected_connects_again(
    held: HeldConnection, one: Redis
) -> None:
    first = await held.command("CLIENT", "ID")
    await one.connection_pool.disconnect()  # as a pool reset does, in use or not
    assert await held.command("CLIENT", "ID") != first


# HeldConnections ---------------------------------------------------------------------------------


async def test_held_connections_are_kept_and_lent_one_caller_at_a_time(backing: Servers) -> None:
    """Commands one after another go on one kept connection; one sent while it is lent gets another
    (up to `most`); past `most`, a command goes through the pool (`bare_command`) without waiting."""
    client = connect(backing.redis_url, max_connections=4)
    lent = HeldConnections(client, 2)
    try:
        first = await lent.command("CLIENT", "ID")
        assert {await lent.command("CLIENT", "ID") for _ in range(3)} == {first}
        await client.delete("lent:list")
        blocked = [asyncio.create_task(lent.command("BLPOP", "lent:list", 2)) for _ in range(2)]
        await asyncio.sleep(0.2)
        meanwhile = await asyncio.wait_for(lent.command("CLIENT", "ID"), 1)  # both lent: by the pool
        await client.rpush("lent:list", "a", "b")
        assert sorted(await asyncio.gather(*blocked)) == [[b"lent:list", b"a"], [b"lent:list", b"b"]]
        kept = {await lent.command("CLIENT", "ID") for _ in range(4)}
        assert first in kept and meanwhile not in kept
    finally:
        await lent.close()
        await client.aclose()
        await client.connection_pool.disconnect()
