"""Clients of a Sentinel-managed primary (worker/connections.py, worker/sentinel.py) across a forced
failover, on a real Sentinel set: every write the asyncio pool, a held connection, `bare_command`
and RQ's synchronous client report done is kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from functools import partial

import pytest
from redis import Redis as SyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.support.sentinel import MASTER, SentinelSet, sentinel_set
from tests.support.stack import wait_for
from worker.connections import HeldConnection, bare_command, connect, sync_client
from worker.sentinel import sentinel_url

pytestmark = [pytest.mark.integration, pytest.mark.faults]


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    with sentinel_set() as running:
        yield running


async def test_every_write_reported_done_across_a_failover_is_kept(sentinels: SentinelSet) -> None:
    """INCRs sent every 20 ms through each way of sending, across SENTINEL FAILOVER: once the old
    primary is a replica, each counter on the new primary holds every INCR that was answered (and
    at most those whose answer the failover cut off besides)."""
    url = sentinel_url(sentinels.sentinels, MASTER)
    client = connect(url, max_connections=4, timeout_seconds=2)
    held = HeldConnection(client)
    sync = sync_client(url, 2)  # RQ's
    sends = {
        "pool": lambda: client.incr("pool"),
        "held": lambda: held.command("INCR", "held"),
        "bare": lambda: bare_command(client, "INCR", "bare"),
        "sync": lambda: asyncio.to_thread(sync.incr, "sync"),
    }
    answered = dict.fromkeys(sends, 0)
    unanswered = dict.fromkeys(sends, 0)  # may have run or not: their connection dropped mid-command
    await client.ping()  # each pool's first connection starts its watch of the sentinels
    sync.ping()
    listened = partial(sentinels.all_listened_to, 2)
    await asyncio.to_thread(wait_for, listened, what="both pools to listen to the sentinels")
    before = sentinels.primary()
    failing_over = asyncio.create_task(asyncio.to_thread(sentinels.fail_over))
    stop_at = None
    while stop_at is None or time.monotonic() < stop_at:
        for name, send in sends.items():
            try:
                await send()
                answered[name] += 1
            except RedisConnectionError:  # the failover's outage
                unanswered[name] += 1
        if stop_at is None and failing_over.done():
            stop_at = time.monotonic() + 2  # writes go on a while on the new primary
        await asyncio.sleep(0.02)
    after = await failing_over
    await held.close()
    sync.close()
    await client.aclose()
    await client.connection_pool.disconnect()
    await asyncio.to_thread(sentinels.wait_demoted, before)
    with SyncRedis(host=after[0], port=after[1], socket_timeout=5) as primary:
        kept = {name: int(primary.get(name) or 0) for name in sends}
    for name in sends:
        assert answered[name] <= kept[name] <= answered[name] + unanswered[name], (name, kept, answered)
