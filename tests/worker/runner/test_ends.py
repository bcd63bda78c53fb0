"""Gathered ends (worker/runner/ends.py) on real Postgres: the ends that meet in a window are
recorded in one statement (one transaction: their rows share its id), each fenced on its own
attempt with its own outcome; an end without company is recorded at once, and one that waits is
recorded when a closing worker closes its window; an end whose task is cancelled in the window is
left out; an outage reaches every end of the batch."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from tests.support.stack import free_port
from worker.outages import is_postgres_outage
from worker.postgres import store
from worker.postgres.direct import DirectPool
from worker.runner.ends import GatheredEnds

pytestmark = pytest.mark.integration

_ROW: dict[str, Any] = {
    "owner": "ends",
    "status": "queued",
    "model": "m",
    "background": True,
    "store": True,
    "stream": False,
    "request": {"model": "m"},
    "previous_response_id": None,
    "conversation": [{"id": "msg_1", "type": "message", "role": "user", "content": "hi"}],
    "chain_depth": 0,
    "conversation_id": None,
}


async def _rows(pool: DirectPool, status: str = "queued", count: int = 1) -> list[str]:
    ids = [f"resp_ends_{uuid.uuid4().hex}" for _ in range(count)]
    async with pool.connection() as conn:
        for response_id in ids:
            row = {
                **_ROW,
                "id": response_id,
                "status": status,
                "response": {"id": response_id, "status": status},
            }
            await store.insert_response(conn, row, len(row["conversation"]))
    return ids


async def _read(pool: DirectPool, response_id: str) -> tuple[str, int, Any, Any, str]:
    """Its status, attempt, Response, error and the transaction that last wrote it (`xmin`)."""
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT status, attempt, response, error, xmin::text FROM response WHERE id = %s", (response_id,)
        )
        row = await cursor.fetchone()
    assert row is not None
    return row


def _final(response_id: str, status: str = "completed") -> dict[str, Any]:
    final: dict[str, Any] = {"id": response_id, "status": status, "output": [{"type": "message", "n": 1.5}]}
    if status == "failed":
        final["error"] = {"code": "server_error", "message": "é ☃"}
    return final


async def test_ends_that_meet_in_a_window_are_one_transaction_each_fenced_on_its_own(
    pool: DirectPool,
) -> None:
    """The first two of a burst come alone and are recorded at once; the rest meet in the window the
    third opens and are recorded together, each row on its own fence."""
    lead, second_lead, completed, failed, cancelled, taken_over = await _rows(pool, count=6)
    async with pool.connection() as conn:
        await conn.execute("UPDATE response SET status = 'cancelled' WHERE id = %s", (cancelled,))
        assert await store.start_attempt(conn, taken_over, 2) is not None
    ends = GatheredEnds(pool, window_seconds=0.2)
    outcomes = await asyncio.gather(
        ends.finish(lead, 1, _final(lead)),
        ends.finish(second_lead, 1, _final(second_lead)),
        ends.finish(completed, 1, _final(completed)),
        ends.finish(failed, 1, _final(failed, "failed")),
        ends.finish(cancelled, 1, _final(cancelled)),
        ends.finish(taken_over, 1, _final(taken_over)),
    )
    assert outcomes == [True, True, True, True, False, False]
    first, second = await _read(pool, completed), await _read(pool, failed)
    assert first[:4] == ("completed", 1, _final(completed), None)
    assert second[:4] == ("failed", 1, _final(failed, "failed"), {"code": "server_error", "message": "é ☃"})
    assert first[4] == second[4]  # one statement, one commit
    assert len({(await _read(pool, response_id))[4] for response_id in (lead, second_lead, completed)}) == 3
    assert (await _read(pool, cancelled))[:2] == ("cancelled", 0)  # another outcome's: untouched
    assert (await _read(pool, taken_over))[:2] == ("in_progress", 2)


async def test_an_end_without_company_is_recorded_at_once(pool: DirectPool) -> None:
    """An end with fewer than two before it in the window's length does not wait (a window of ten
    minutes); the third waits for the window it opens, and is recorded at its close (here a worker's
    shutdown's)."""
    first, second, third = await _rows(pool, status="in_progress", count=3)
    ends = GatheredEnds(pool, window_seconds=600)
    assert await asyncio.wait_for(ends.finish(first, 3, _final(first)), 10)
    assert (await _read(pool, first))[:3] == ("completed", 3, _final(first))
    assert await asyncio.wait_for(ends.finish(second, 3, _final(second)), 10)
    waiting = asyncio.create_task(ends.finish(third, 3, _final(third)))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    assert (await _read(pool, third))[0] == "in_progress"
    await ends.close()
    assert await waiting
    assert (await _read(pool, third))[0] == "completed"


async def test_an_end_cancelled_in_its_window_is_left_out(pool: DirectPool) -> None:
    """A task cancelled while its end waits (its lease lost, its worker stopping) has recorded nothing;
    the window's other ends are recorded."""
    *leads, left, kept = await _rows(pool, count=4)
    ends = GatheredEnds(pool, window_seconds=0.3)
    for lead in leads:
        assert await ends.finish(lead, 1, _final(lead))
    leaving = asyncio.create_task(ends.finish(left, 1, _final(left)))
    staying = asyncio.create_task(ends.finish(kept, 1, _final(kept)))
    await asyncio.sleep(0.05)
    leaving.cancel()
    assert await staying
    assert leaving.cancelled()
    assert (await _read(pool, left))[:2] == ("queued", 0)
    assert (await _read(pool, kept))[:2] == ("completed", 1)


async def test_an_end_whose_row_is_refused_fails_alone(pool: DirectPool) -> None:
    """A statement that one end's row makes fail (here a NUL, which no Postgres text holds) is tried
    again end by end: that end raises what Postgres said, the others are recorded."""
    *leads, good, bad, other = await _rows(pool, count=5)
    ends = GatheredEnds(pool, window_seconds=0.2)
    for lead in leads:
        assert await ends.finish(lead, 1, _final(lead))
    outcomes = await asyncio.gather(
        ends.finish(good, 1, _final(good)),
        ends.finish(bad, 1, {**_final(bad), "output": [{"text": "nul \x00"}]}),
        ends.finish(other, 1, _final(other)),
        return_exceptions=True,
    )
    assert outcomes[0] is True and outcomes[2] is True
    assert isinstance(outcomes[1], psycopg.DataError) and not is_postgres_outage(outcomes[1])
    assert (await _read(pool, bad))[0] == "queued"
    assert (await _read(pool, good))[0] == (await _read(pool, other))[0] == "completed"


async def test_an_outage_reaches_every_end_of_the_batch() -> None:
    nowhere = DirectPool(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none", 1, wait_seconds=1)
    ends = GatheredEnds(nowhere, window_seconds=0.05)
    try:
        outcomes = await asyncio.gather(
            *(ends.finish(f"resp_{n}", 1, _final(f"resp_{n}")) for n in range(4)), return_exceptions=True
        )
    finally:
        await nowhere.close()
    assert len(outcomes) == 4  # the first two alone, the other two gathered
    assert all(isinstance(outcome, Exception) and is_postgres_outage(outcome) for outcome in outcomes)
