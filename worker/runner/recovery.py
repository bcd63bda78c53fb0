"""Responses nobody will finish, and retention (DESIGN.md §4 "Orphans", §2.7).

RQ's maintenance retries the job of a worker that died (worker/queue.py); the next attempt then
runs the response again, or ends it when output had already reached clients (worker/runner/attempt.py).
The sweep handles what that cannot: it ends `failed`, with a message saying why, every live row
(queued or in progress) that is older than a grace period, whose lease nobody holds, and whose job
RQ no longer holds as waiting or running (it gave up after `max_attempts`, or Redis lost the job).
In-progress rows are all looked at every sweep; queued rows, a bounded number of pages per sweep
(`end_orphans`). It also deletes stored responses finished more than `retention_days` ago, and
webhook deliveries that ended as long ago.

Every worker runs it every `maintenance_seconds`; a Redis lock lets one of them at a time do it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

import orjson
from rq.job import JobStatus

from worker.keys import lease_key, sweep_cursor_key, sweep_lock_key
from worker.postgres import deliveries, store
from worker.protocol.response import Status
from worker.runner.attempt import end_response
from worker.runner.runtime import Runtime
from worker.settings import Settings

log = logging.getLogger("respool.recovery")

BATCH = 500
# Pages of queued rows one sweep reads (see end_orphans), and how long the place it stopped is kept.
QUEUED_PAGES = 4
CURSOR_TTL = 3600
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
    if not await rt.redis.set(sweep_lock_key(settings.queue), rt.holder, nx=True, px=lock_ms):
        return 0
    ended = await end_orphans(rt, settings, job_statuses)
    # Each statement its own transaction (autocommit), here and in the pages below: a sweep runs
    # every few seconds on an idle system too, and BEGIN and COMMIT were two round trips of three.
    async with rt.autocommit.connect() as conn:
        deleted = await store.delete_expired(conn, settings.retention_days, BATCH)
        await deliveries.delete_expired(conn, settings.retention_days, BATCH)
    if deleted:
        log.info("deleted %d responses past retention (%s days)", deleted, settings.retention_days)
    return ended


async def end_orphans(
    rt: Runtime, settings: Settings, job_statuses: JobStatuses, batch: int = BATCH, pages: int = QUEUED_PAGES
) -> int:
    """End orphaned live responses (see the module docstring); the number ended.

    Two lanes. Every in-progress row is looked at each sweep, a page at a time: they are few (what
    the workers run) and hold nearly every orphan (a worker died, or RQ gave its job up), so these
    are ended within one sweep. Queued rows can be a backlog of any depth, nearly all held by RQ;
    an orphan among them means Redis lost its job. Each sweep reads at most `pages` pages of them,
    from where the last sweep (of any worker) stopped, starting over after the newest: every queued
    row is still looked at, at a bounded cost per sweep.
    """
    grace = max(10.0, 2.0 * settings.registry_seconds)

    async def page(status: Status, after: store.LivePosition | None) -> tuple[store.LivePosition | None, int]:
        """End the unheld of one page after `after`: where the next page starts (None: this was
        the last), and the number ended."""
        async with rt.autocommit.connect() as conn:
            rows = await store.live_response_ids(conn, status, grace, batch, after)
        ended = await _end_unheld(rt, [response_id for _, response_id in rows], job_statuses)
        return (rows[-1] if len(rows) == batch else None), ended

    total, after = 0, None
    while True:
        after, ended = await page(Status.IN_PROGRESS, after)
        total += ended
        if after is None:
            break
    cursor = sweep_cursor_key(settings.queue)
    after = _position(await rt.redis.get(cursor))
    for _ in range(pages):
        after, ended = await page(Status.QUEUED, after)
        total += ended
        if after is None:
            await rt.redis.delete(cursor)  # the newest reached: the next sweep starts over
            break
        await rt.redis.set(cursor, orjson.dumps([after[0].isoformat(), after[1]]), ex=CURSOR_TTL)
    return total


def _position(raw: bytes | str | None) -> store.LivePosition | None:
    """A stored cursor; none (start over) if there is none or it cannot be read."""
    try:
        created_at, response_id = orjson.loads(raw) if raw else (None, None)
        return (datetime.fromisoformat(created_at), str(response_id)) if created_at else None
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None


async def _end_unheld(rt: Runtime, candidates: list[str], job_statuses: JobStatuses) -> int:
    """End those of `candidates` nobody holds: no lease, and no job RQ will still run."""
    if not candidates:
        return 0
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
