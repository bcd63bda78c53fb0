"""Responses nobody will finish, and retention (DESIGN.md §4 "Orphans", §2.7).

A running response whose holder missed its deadline (its worker died, or froze past its lease) is
put back at the front of the queue (worker/queue.py), unless it has been run `max_attempts` times:
then it is given up, ended `failed` saying so. What a dead worker had popped and never leased goes
back too. The next attempt runs the response again, or ends it when output had already reached
clients (worker/runner/attempt.py). The sweep also ends `failed`, with a message saying why, every
live row (queued or in progress) that is older than a grace period, whose lease nobody holds, and
which the queue does not hold (Redis lost it). In-progress rows are all looked at every sweep;
queued rows, a bounded number of pages per sweep (`end_orphans`). It also deletes stored responses
finished more than `retention_days` ago, and webhook deliveries that ended as long ago.

Every worker runs it every `maintenance_seconds`, the orphans' part every fifth time
(`rare_seconds`); a Redis lock lets one of them at a time do it.
"""

from __future__ import annotations

import logging
from datetime import datetime

import orjson

from worker.keys import attempt_key, lease_key, sweep_cursor_key, sweep_lock_key
from worker.postgres import deliveries, store
from worker.protocol.response import Status
from worker.queue import held_by_a_queue
from worker.runner.attempt import end_response
from worker.runner.runtime import Runtime
from worker.settings import Settings

log = logging.getLogger("respool.recovery")

BATCH = 500
# Pages of queued rows one sweep reads (see end_orphans), and how long the place it stopped is kept.
QUEUED_PAGES = 4
CURSOR_TTL = 3600
LOST_JOB = "respool lost this response's job (its queue data was lost) before it finished. Retry the request."
GIVEN_UP = (
    "The worker running this response stopped before it finished, each time respool ran it "
    "(RESPOOL_MAX_ATTEMPTS); it was given up. Retry the request."
)


def retention_seconds(settings: Settings) -> float:
    """How often the sweep deletes what is past retention: a tenth of the retention, at most a
    minute (RESPOOL_RETENTION_DAYS is days: its deletes need not come every few seconds, and an idle
    worker's sweep was two statements the cheaper without them)."""
    return min(60.0, settings.retention_days * 86400 / 10)


def rare_seconds(settings: Settings) -> float:
    """How often a worker's sweep looks for what only rarer failures leave (orphans, abandoned or
    expired deliveries): every fifth maintenance. Their statements were most of an idle worker's
    CPU at every one, and an orphan waits out a grace of 10 s or more anyway."""
    return 5.0 * settings.maintenance_seconds


async def sweep(
    rt: Runtime, settings: Settings, *, retention: bool = True, orphans: bool = True
) -> int | None:
    """One sweep, if no other process is sweeping (None if one was): the number of responses it
    ended. With `orphans`, it also ends orphans; with `retention`, it deletes what is past retention."""
    lock_ms = int(settings.maintenance_seconds * 1000)
    # One lock per queue: deployments sharing a Redis each sweep their own responses.
    if not await rt.redis.set(sweep_lock_key(settings.queue), rt.holder, nx=True, px=lock_ms):
        return None
    ended = 0
    # Just after Redis was unreachable (or this worker started), a missed deadline or a lapsed
    # lease says nothing yet: their live holders renew them within a heartbeat (`Runtime.recovering`).
    if not rt.recovering():
        ended += await take_back(rt, settings.max_attempts)
        if orphans:
            ended += await end_orphans(rt, settings)
    if not retention:
        return ended
    # Each statement its own transaction (autocommit), here and in the pages below: a sweep runs
    # every few seconds on an idle system too, and BEGIN and COMMIT were two round trips of three.
    async with rt.autocommit.connect() as conn:
        deleted = await store.delete_expired(conn, settings.retention_days, BATCH)
        await deliveries.delete_expired(conn, settings.retention_days, BATCH)
    if deleted:
        log.info("deleted %d responses past retention (%s days)", deleted, settings.retention_days)
    return ended


async def take_back(rt: Runtime, max_attempts: int, batch: int = BATCH) -> int:
    """Put back at the front of the queue every running response whose holder missed its deadline
    and whose lease is gone, or give it up (end it `failed`) once it has been run `max_attempts`
    times; hand back what dead workers had popped. The number given up."""
    moved = await rt.queue.dead_workers()
    if moved:
        log.warning("put back %d responses that dead workers had taken and not started", moved)
    adopted = await rt.queue.adopt()
    if adopted:
        log.info("took %d responses an earlier release had queued as RQ jobs into the queue", adopted)
    overdue = await rt.queue.overdue(batch)
    if not overdue:
        return 0
    async with rt.redis.pipeline(transaction=False) as pipe:
        for response_id in overdue:
            pipe.exists(lease_key(response_id))
            pipe.get(attempt_key(response_id))
        replies = await pipe.execute()
    leased, put_back, given_up = [], [], []
    for index, response_id in enumerate(overdue):
        is_leased, attempts = replies[2 * index], int(replies[2 * index + 1] or 0)
        if is_leased:
            leased.append(response_id)  # its holder's heartbeat is late: not abandoned yet
        elif attempts >= max_attempts:
            given_up.append(response_id)
        else:
            put_back.append(response_id)
    await rt.queue.extend(leased)
    await rt.queue.requeue(put_back)
    for response_id in put_back:
        log.warning("response %s: its worker stopped holding it; back in the queue", response_id)
    ended = 0
    for response_id in given_up:
        if await end_response(rt, response_id, GIVEN_UP):
            log.warning("response %s: given up after %d attempts", response_id, max_attempts)
            rt.metrics.orphans.inc()
            ended += 1
    await rt.queue.drop(given_up)
    return ended


async def end_orphans(rt: Runtime, settings: Settings, batch: int = BATCH, pages: int = QUEUED_PAGES) -> int:
    """End orphaned live responses (see the module docstring); the number ended.

    Two lanes. Every in-progress row is looked at each sweep, a page at a time: they are few (what
    the workers run), so an orphan among them is ended within one sweep. Queued rows can be a
    backlog of any depth, nearly all held by the queue; an orphan among them means Redis lost it. Each sweep reads at most `pages` pages of them,
    from where the last sweep (of any worker) stopped, starting over after the newest: every queued
    row is still looked at, at a bounded cost per sweep.
    """
    grace = max(10.0, 2.0 * settings.registry_seconds)

    async def page(status: Status, after: store.LivePosition | None) -> tuple[store.LivePosition | None, int]:
        """End the unheld of one page after `after`: where the next page starts (None: this was
        the last), and the number ended."""
        async with rt.autocommit.connect() as conn:
            rows = await store.live_response_ids(conn, status, grace, batch, after)
        ended = await _end_unheld(rt, [response_id for _, response_id in rows])
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


async def _end_unheld(rt: Runtime, candidates: list[str]) -> int:
    """End those of `candidates` nobody holds: no lease, and in no queue (Redis lost them)."""
    if not candidates:
        return 0
    async with rt.redis.pipeline(transaction=False) as pipe:
        for response_id in candidates:
            pipe.exists(lease_key(response_id))
        leased = await pipe.execute()
    unleased = [rid for rid, is_leased in zip(candidates, leased, strict=True) if not is_leased]
    if not unleased:
        return 0
    # Any queue's: a Postgres may serve deployments with a queue each, and each sweeps every live row.
    held = await held_by_a_queue(rt.redis, unleased)
    log.debug(
        "sweep: %d live, %d unleased, %d of them held by a queue", len(candidates), len(unleased), sum(held)
    )
    ended = 0
    for response_id, is_held in zip(unleased, held, strict=True):
        if is_held:
            continue
        if await end_response(rt, response_id, LOST_JOB):
            log.warning("response %s: ended failed, the queue having lost it", response_id)
            rt.metrics.orphans.inc()
            ended += 1
    return ended
