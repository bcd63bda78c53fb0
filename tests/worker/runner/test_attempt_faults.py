"""An attempt that breaks on something other than its upstream (a fault of respool's own) ends its
response `failed`, on real Redis and Postgres (worker/runner/attempt.py, `_fail_unexpectedly`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import orjson
import pytest
from redis import Redis

from tests.support.stack import Servers, fresh_database
from worker.events.stream import encode, entry_id, take_lease
from worker.keys import events_key
from worker.postgres import store
from worker.protocol.request import parse_create_request
from worker.protocol.response import Status, build_response
from worker.runner.attempt import _fail_unexpectedly
from worker.runner.runtime import close_runtime, open_runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(backing: Servers) -> Iterator[Settings]:
    with fresh_database(backing.database_url) as url:
        yield Settings(redis_url=backing.redis_url, database_url=url, queue=f"faults-{uuid.uuid4().hex[:8]}")


async def test_a_background_response_whose_attempt_broke_ends_failed(settings: Settings) -> None:
    """A background response's row says `queued` while its first attempt runs (its end would claim
    it): an attempt that breaks there still ends it `failed`, in Postgres and on its stream."""
    request = parse_create_request({"model": "synthetic", "input": "x", "background": True})
    response_id = f"resp_{uuid.uuid4().hex}"
    response = build_response(request, response_id, int(time.time()), Status.QUEUED)
    rt = await open_runtime(settings, "test:faults", 1)
    try:
        async with rt.direct.connection() as conn:
            await store.insert_response(conn, store.new_row("faults", request, response, [], 0), 0)
        created = encode({"type": "response.created", "response": response}, 0)
        with Redis.from_url(settings.redis_url) as redis:
            redis.xadd(events_key(response_id), {"t": created.type, "d": created.data}, id=entry_id(0))
        acquired = await take_lease(rt.leases, response_id, rt.holder)
        assert acquired is not None
        lease, _ = acquired
        try:
            raise RuntimeError("a fault of respool's own")
        except RuntimeError:
            assert await _fail_unexpectedly(rt, lease)
        async with rt.direct.connection() as conn:
            stored = await store.get_response(conn, response_id)
        assert stored is not None and stored.status is Status.FAILED
        assert stored.response["error"]["message"] == "The server had an error while running this response."
        with Redis.from_url(settings.redis_url) as redis:
            (_, last), *_ = redis.xrevrange(events_key(response_id), count=1)
        assert last[b"t"] == b"response.failed"
        assert orjson.loads(last[b"d"])["response"]["status"] == "failed"
    finally:
        await close_runtime(rt)
