"""Fixtures shared by the worker's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from tests.support.stack import Servers, fresh_database
from worker.connections import connect
from worker.postgres.direct import DirectPool


@pytest.fixture
async def redis(backing: Servers) -> AsyncIterator[Redis]:
    """A pooled asyncio client on the test Redis, as each respool process builds one."""
    client = connect(backing.redis_url, max_connections=4)
    yield client
    await client.aclose()
    await client.connection_pool.disconnect()  # the client does not own a pool it was given


@pytest.fixture(scope="module")
def database(backing: Servers) -> Iterator[str]:
    """A fresh database with respool's schema, for one test module."""
    with fresh_database(backing.database_url) as url:
        yield url


@pytest.fixture
async def pool(database: str) -> AsyncIterator[DirectPool]:
    """A direct pool of two connections on it (a checkout waits half a second at most)."""
    pool = DirectPool(database, 2, wait_seconds=0.5)
    yield pool
    await pool.close()
