"""Responses nobody will finish, and retention (DESIGN.md §4 "Orphans", §2.7).

RQ's maintenance retries the job of a worker that died (worker/queue.py); the next attempt then
runs the response again, or ends it when output had already reached clients (worker/runner.py).
The sweep handles what that cannot: it ends `failed`, with a message saying why, every live row
(queued or in progress) that is older than a grace period, whose lease nobody holds, and whose job
RQ no longer holds as waiting or running (it gave up after `max_attempts`, or Redis lost the job).
It also deletes stored responses finished more than `retention_days` ago.

Every worker runs it every `maintenance_seconds`; a Redis lock lets one of them at a time do it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rq.job import JobStatus

from worker import store
from worker.keys import PREFIX, lease_key
from worker.runner import Runtime, end_response
from worker.settings import Settings

log = logging.getLogger("respool.recovery")

BATCH = 500
# Job states in which RQ will still run, or is running, the job.
_HELD = frozenset(
    {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED, JobStatus.CREATED}
)

LOST_JOB = "respool lost this response's job (its queue data was lost) before it finished. Retry the request."
GIVEN_UP = (
    "The worker running this response stopped before it finished, each time respool ran it "
    "(RESPOOL_MAX_ATTEMPTS); it was given up. Retry the request."
)

JobStatuses = Callable[[list[str]], dict[str, JobStatus | None]]


async def sweep(rt: Runtime, settings: Settings, job_statuses: JobStatuses) -> int:
    """One sweep, if no other process is sweeping; the number of responses it ended."""
    lock_ms = int(settings.maintenance_seconds * 1000)
    # One lock per queue: deployments sharing a Redis each sweep their own responses.
    if not await rt.redis.set(f"{PREFIX}:sweep:{settings.queue}", rt.holder, nx=True, px=lock_ms):
        return 0
    ended = await end_orphans(rt, settings, job_statuses)
    async with rt.engine.begin() as conn:
        deleted = await store.delete_expired(conn, settings.retention_days, BATCH)
    if deleted:
        log.info("deleted %d responses past retention (%s days)", deleted, settings.retention_days)
    return ended


async def end_orphans(rt: Runtime, settings: Settings, job_statuses: JobStatuses, batch: int = BATCH) -> int:
    """End every orphaned live response (see the module docstring); the number ended. Every live
    row is looked at, a page at a time: a backlog of queued responses (held by RQ) must not hide
    an orphan behind it."""
    grace = max(10.0, 2.0 * settings.registry_seconds)
    ended, after = 0, None
    while True:
        async with rt.engine.connect() as conn:
            page = await store.live_response_ids(conn, grace, batch, after)
        if page:
            ended += await _end_unheld(rt, [response_id for _, response_id in page], job_statuses)
        if len(page) < batch:
            return ended
        after = page[-1]


async def _end_unheld(rt: Runtime, candidates: list[str], job_statuses: JobStatuses) -> int:
    """End those of `candidates` nobody holds: no lease, and no job RQ will still run."""
    async with rt.redis.pipeline(transaction=False) as pipe:
        for response_id in candidates:
            pipe.exists(lease_key(response_id))
        leased = await pipe.execute()
    unleased = [rid for rid, is_leased in zip(candidates, leased, strict=True) if not is_leased]
    if not unleased:
        return 0
    statuses = await asyncio.to_thread(job_statuses, unleased)
    log.debug("sweep: %d live, %d unleased: %s", len(candidates), len(unleased), statuses)
    ended = 0
    for response_id in unleased:
        status = statuses.get(response_id)
        if status in _HELD:
            continue
        # A job RQ has no record of, or that "finished" with its row still live (Redis lost the
        # response's keys under it), was lost; one RQ failed, stopped or cancelled was given up.
        is_lost = status is None or status is JobStatus.FINISHED
        message = LOST_JOB if is_lost else GIVEN_UP
        if await end_response(rt, response_id, message):
            log.warning("response %s: ended failed, its job being %s", response_id, status or "lost")
            rt.metrics.orphans.inc()
            ended += 1
    return ended
