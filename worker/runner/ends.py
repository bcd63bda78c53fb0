"""Background responses' ends, gathered for a moment and committed together (DESIGN.md §2.3, §7).

A background response nobody follows live (created with `background: true` and no `stream`: its
client polls, at 250 ms or more) ends no sooner for a client than its next poll. While others are
ending too, its end may wait a few milliseconds for theirs (`RESPOOL_GATHER_ENDS_MS`): the ends
that meet in that window go to Postgres as one statement, each row fenced on its own attempt
(`store.mark_all_finished`), with one commit; their final appends then leave together and share
one Redis round trip (`EventLog`'s batching). A response that comes alone costs its worker a
wake-up for its end's statement and one for its last append, and Postgres a commit, each its own
(README, CPU cost); gathered, the responses that meet share them.

Nothing is weakened: an end waiting here is an end not yet recorded, as one whose statement is in
flight is; a worker that dies meanwhile leaves the response live under its lease, and another
worker resumes it (DESIGN.md §4). Each response's outcome is its own: a row another outcome had
ended (a cancel) is not touched, and only its response is told so; a statement that one end's row
made fail (not an outage) is tried again end by end, so the fault is that end's alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from worker.outages import is_outage
from worker.postgres import store
from worker.postgres.direct import DirectPool

type _End = tuple[str, int, dict[str, Any], asyncio.Future[bool]]


class GatheredEnds:
    """Ends recorded in gathered batches: an end that comes with company (two ends before it within
    `window_seconds`) opens a window as long, those that come meanwhile join it, and its close
    records them all in one statement. Any other end is recorded at once: waiting would buy it
    nothing and cost it a wake-up of its own for the window's close, its process asleep meanwhile
    and its caches cold, and a client that polls fast a poll more. One end before it is not company
    enough: a client that polls every 20 ms and creates the next response once one ends makes an end
    every 20-40 ms, none of which a window ever shares (a lone background response 1.16x, its polls
    1.5 a response, when one end before was enough; README, CPU cost)."""

    def __init__(
        self, direct: DirectPool, window_seconds: float, on_batch: Callable[[int], object] | None = None
    ) -> None:
        self._direct = direct
        self._window_seconds = window_seconds
        self._on_batch = on_batch  # told how many ends each statement carried
        self._waiting: list[_End] = []
        self._timer: asyncio.TimerHandle | None = None
        self._ends_at = (float("-inf"), float("-inf"))  # when the two last ends came (loop time)
        self._committing: set[asyncio.Task[None]] = set()

    async def finish(self, response_id: str, attempt: int, response: dict[str, Any]) -> bool:
        """Record the final Response, fenced on `attempt`, with whichever ends meet it in the window;
        False means another outcome won. An outage raises as the statement met it (each caller
        tries again on its own)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        company = now - self._ends_at[0] < self._window_seconds  # two ends before it, that recently
        self._ends_at = (self._ends_at[1], now)
        if self._timer is None and not company:  # alone: recorded at once, as if never gathered
            async with self._direct.connection() as conn:
                return await store.mark_finished(conn, response_id, attempt, response)
        future: asyncio.Future[bool] = loop.create_future()
        self._waiting.append((response_id, attempt, response, future))
        if self._timer is None:
            self._timer = loop.call_later(self._window_seconds, self._close_window)
        return await future

    def _close_window(self) -> None:
        self._timer = None
        # An end whose task was cancelled meanwhile (its lease lost, its worker stopping) is left out:
        # it was never recorded, as an end whose statement had not been sent.
        batch = [end for end in self._waiting if not end[3].done()]
        self._waiting = []
        if batch:
            if self._on_batch is not None:
                self._on_batch(len(batch))
            task = asyncio.get_running_loop().create_task(self._commit(batch))
            self._committing.add(task)
            task.add_done_callback(self._committing.discard)

    async def _commit(self, batch: list[_End]) -> None:
        try:
            async with self._direct.connection() as conn:
                if len(batch) == 1:  # alone: the one-row statement, prepared for every end
                    rid, attempt, response, _ = batch[0]
                    won = {rid} if await store.mark_finished(conn, rid, attempt, response) else set()
                else:
                    won = await store.mark_all_finished(conn, [end[:3] for end in batch])
        except Exception as exc:
            if len(batch) > 1 and not is_outage(exc):  # one end's fault (its row refused): each alone
                for end in batch:
                    if not end[3].done():  # its task not cancelled meanwhile
                        await self._commit([end])
                return
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for rid, _, _, future in batch:
            if not future.done():
                future.set_result(rid in won)

    async def close(self) -> None:
        """Record what waits now, and wait for every batch in flight (a worker's shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._close_window()
        if self._committing:
            await asyncio.gather(*self._committing, return_exceptions=True)
