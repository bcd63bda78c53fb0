"""A worker's runtime: what waits for a response to run."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from worker.runner.runtime import Runtime


async def test_until_running_waits_while_no_response_runs_and_returns_once_one_starts() -> None:
    """The cancel watch sleeps while the worker runs nothing (an idle worker's event loop is not
    woken for it) and goes on as soon as a response starts (`attempt.run_response` sets `started`),
    however long before that the flag was last set."""
    rt = SimpleNamespace(running={}, started=asyncio.Event())
    rt.started.set()  # set by a response that ran and ended before
    waiting = asyncio.ensure_future(Runtime.until_running(rt))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not waiting.done()  # no response runs: it waits, whatever ran before

    rt.running["resp_1"] = object()  # a response starts, as attempt.run_response does it
    rt.started.set()
    await asyncio.wait_for(waiting, timeout=1)

    # While one runs, at once.
    await asyncio.wait_for(Runtime.until_running(rt), timeout=0.01)  # type: ignore[arg-type]
