"""Fixtures shared by the worker's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from tests.support.stack import Servers
from worker.connections import connect


@pytest.fixture
async def redis(backing: Servers) -> AsyncIterator[Redis]:
    """A pooled asyncio client on the test Redis, as each respool process builds one."""
    client = connect(backing.redis_url, max_connections=4)
    yield client
    await client.aclose()
    await client.connection_pool.disconnect()  # the client does not own a pool it was given
