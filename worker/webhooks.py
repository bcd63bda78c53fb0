"""Telling owners that their background responses ended (DESIGN.md §12), as both processes' sides
do it: whichever commits a response's end (a worker's attempt or sweep, an API's cancel) records
the deliveries in that same transaction (`record`), then queues their first attempts (`send`).

A send that fails (Redis away, the process dying right after the commit) loses nothing: the
deliveries are pending in Postgres, and every worker's sweep queues pending ones that are due
(worker/runner/deliveries.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError
from rq import Queue
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.postgres import deliveries
from worker.protocol.webhooks import Endpoint, event_type
from worker.queue import enqueue_deliveries

log = logging.getLogger("respool.webhooks")


class Notifier:
    """The configured endpoints, and the deliveries' queue."""

    def __init__(self, endpoints: Sequence[Endpoint], redis: Redis, queue: Queue) -> None:
        self.endpoints = tuple(endpoints)
        self.redis = redis
        self.queue = queue

    def wanted(self, owner: str, status: str, *, background: bool) -> bool:
        """Whether a response of `owner` ending `status` sends any event."""
        kind = event_type(status)
        return background and kind is not None and any(e.wants(owner, kind) for e in self.endpoints)

    async def record(self, conn: AsyncConnection, response_id: str, owner: str, status: str) -> list[str]:
        """In the transaction that records the end: one delivery per endpoint that wants it."""
        if not self.endpoints:
            return []
        return await deliveries.record(conn, response_id, owner, status, self.endpoints)

    async def send(self, delivery_ids: list[str]) -> None:
        """After the commit: queue each delivery's first attempt (the sweep does, if this cannot)."""
        try:
            await enqueue_deliveries(self.redis, self.queue, delivery_ids)
        except RedisError as exc:
            log.warning("could not queue %d webhook deliveries (%s); the sweep will", len(delivery_ids), exc)
