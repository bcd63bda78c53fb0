"""Ending responses from the API side (DESIGN.md §2.5): recording a cancel, reaching whoever holds
the response, and ending a stream no worker will end.

A cancel is recorded in Postgres first (it wins atomically, PROTOCOL.md §7); then a flag reaches a
worker running the response, and a job still queued is removed and its stream ended here, under a
lease of the API's own, so the stream's writer is always one.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.events.lease import Leases
from worker.events.stream import EventLog, last_event, take_lease
from worker.events.writer import ResponseWriter, end_stream
from worker.ids import new_id
from worker.keys import cancel_key
from worker.postgres import store
from worker.protocol.response import Status
from worker.queue import ResponseQueue
from worker.settings import Settings
from worker.webhooks import Notifier

CANCEL_FLAG_SECONDS = 3600


class Cancellation:
    """One per API process (the service's): cancels, and ends streams under its own leases."""

    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        autocommit: AsyncEngine,
        redis: Redis,
        queue: ResponseQueue,
        notifier: Notifier,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.autocommit = autocommit
        self.notifier = notifier
        self.redis = redis
        self.queue = queue
        self.leases = Leases(redis, settings.lease_seconds)
        self.log = EventLog(redis)
        self.holder = f"api:{new_id('proc')}"

    async def cancel_live(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """Record the cancel, then reach whoever holds the response; None if it was not live."""
        if not self.notifier.wanted(owner, Status.CANCELLED, background=True):
            async with self.autocommit.connect() as conn:
                cancelled = await store.mark_cancelled(conn, response_id, owner)
        else:  # DESIGN.md §12: the deliveries with the end, in its transaction
            async with self.engine.begin() as conn:
                cancelled = await store.mark_cancelled(conn, response_id, owner)
                delivery_ids = []
                if cancelled is not None:
                    delivery_ids = await self.notifier.record(conn, response_id, owner, Status.CANCELLED)
            await self.notifier.send(delivery_ids)
        if cancelled is None:
            return None
        await self._signal(response_id, cancelled)
        return cancelled

    async def finish(self, response_id: str, cancelled: dict[str, Any]) -> None:
        """A repeated cancel completes one an outage cut short after Postgres recorded it (its 503
        made the SDK retry): the stream is still open, so signal again."""
        last = await last_event(self.redis, response_id)
        if last is not None and not last.is_terminal:
            await self._signal(response_id, cancelled, is_retry=True)

    async def _signal(self, response_id: str, cancelled: dict[str, Any], *, is_retry: bool = False) -> None:
        """Reach whoever holds a cancelled response: the flag stops a worker running it; a job still
        queued is removed and its stream ended here (on a retry, whether or not it was queued)."""
        await self.redis.set(cancel_key(response_id), "1", ex=CANCEL_FLAG_SECONDS)
        if await self.queue.remove_queued(response_id) or is_retry:
            await self.end_stream(response_id, cancelled)

    async def end_stream(self, response_id: str, response: dict[str, Any]) -> None:
        """End a never-run response's stream with its terminal event, under a lease of our own."""
        acquired = await take_lease(self.leases, response_id, self.holder)
        if acquired is None:
            return  # a worker holds it and will end the stream itself
        lease, last = acquired
        try:
            writer = ResponseWriter.after(self.log, lease, last)
            await end_stream(writer, response, self.settings.stream_ttl_seconds)
        finally:
            await self.leases.release(lease)
