"""The event log on a real Redis: fenced appends, and appends after Redis lost its scripts."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import ConnectionPool, Redis

from tests.support.stack import Servers
from worker.events import AppendResult, EventLog, connect, encode, hiredis_packing, read_events
from worker.lease import Leases

pytestmark = pytest.mark.integration


@pytest.fixture
async def redis(backing: Servers) -> AsyncIterator[Redis]:
    client = connect(backing.redis_url, max_connections=4)
    yield client
    await client.aclose()
    await client.connection_pool.disconnect()  # the client does not own a pool it was given


def _events(first: int, count: int) -> list[dict[str, object]]:
    return [{"type": "response.output_text.delta", "delta": f"d{first + index}"} for index in range(count)]


async def test_appends_land_in_order_and_a_stale_lease_is_fenced(redis: Redis) -> None:
    response_id = f"resp_{uuid.uuid4().hex}"
    leases = Leases(redis, 5)
    log = EventLog(redis)
    first = await leases.acquire(response_id, "a")
    assert first is not None
    events = [encode(event, index) for index, event in enumerate(_events(0, 3))]
    assert await log.append(first, events) is AppendResult.OK
    await leases.release(first)
    second = await leases.acquire(response_id, "b")
    assert second is not None
    assert await log.append(first, [encode(_events(3, 1)[0], 3)]) is AppendResult.FENCED
    assert [event.sequence_number for event in await read_events(redis, response_id)] == [0, 1, 2]


async def test_an_append_after_redis_forgot_its_scripts_lands_once(redis: Redis) -> None:
    """Appends send EVALSHA alone (no SCRIPT EXISTS each time); a NOSCRIPT reply (Redis restarted,
    or SCRIPT FLUSH) loads the script and sends just those appends again."""
    response_id = f"resp_{uuid.uuid4().hex}"
    lease = await Leases(redis, 5).acquire(response_id, "a")
    assert lease is not None
    log = EventLog(redis)
    assert await log.append(lease, [encode(_events(0, 1)[0], 0)]) is AppendResult.OK
    await redis.script_flush()
    assert (
        await log.append(lease, [encode(event, 1 + i) for i, event in enumerate(_events(1, 2))])
        is AppendResult.OK
    )
    stored = await read_events(redis, response_id)
    assert [event.payload()["delta"] for event in stored] == ["d0", "d1", "d2"]


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/0", "Connection"),
        ("unix:///tmp/redis.sock", "UnixDomainSocketConnection"),
        ("rediss://127.0.0.1:6379/0", "SSLConnection"),
    ],
)
def test_hiredis_packing_keeps_the_connection_kind_and_packs_as_redis_py_does(url: str, base: str) -> None:
    """hiredis packs every argument kind exactly as redis-py's own Python packer would."""
    pool = hiredis_packing(ConnectionPool.from_url(url))
    assert pool.connection_class.__mro__[2].__name__ == base
    assert hiredis_packing(pool).connection_class is pool.connection_class  # once only
    ours = pool.make_connection()
    theirs = pool.connection_class.__mro__[2](**pool.connection_kwargs)
    for args in (
        ("XADD", "key", "0-1", "t", "response.created", "d", b'{"a":"\xc3\xa9"}'),
        ("CONFIG GET", "maxmemory"),
        ("EVALSHA", "f" * 40, 3, "a", "b", "c", 1.5, "é"),
    ):
        assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))
