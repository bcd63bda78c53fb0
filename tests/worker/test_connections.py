"""`bare_command`, the hot paths' way to send one command (worker/connections.py), on real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from tests.support.stack import Servers
from worker.connections import bare_command, connect

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


async def test_a_command_cancelled_before_its_reply_leaves_no_reply_behind(one: Redis, redis: Redis) -> None:
    """The reply of a cancelled command must not answer the next one: its connection is closed."""
    await redis.delete("bare:list")
    blocked = await bare_command(one, "CLIENT", "ID")
    waiting = asyncio.create_task(bare_command(one, "BLPOP", "bare:list", 5))
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # Redis notices the close on its own time: until then the BLPOP would still take what comes.
    for _ in range(250):
        if not await redis.execute_command("CLIENT", "LIST", "ID", blocked):
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the cancelled command's connection was kept open")
    await redis.rpush("bare:list", "late")  # no one blocks on it any more
    assert await bare_command(one, "ECHO", "next") == b"next"
    assert await redis.lpop("bare:list") == b"late"
