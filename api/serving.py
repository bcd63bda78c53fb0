"""The API process's HTTP server: uvicorn's, ticking once a second instead of ten times.

uvicorn's server wakes every 100 ms for its tick, which refreshes the Date header (once a second)
and looks whether a signal asked it to exit: ten wakes a second, an idle API's whole CPU. Here the tick comes once a second, and a signal wakes it at once, so a stop starts as
soon as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from types import FrameType

import uvicorn

_TICK_SECONDS = 1.0
_STARTUP_FAILURE = 3  # uvicorn's exit status when the app does not start (uvicorn.main.STARTUP_FAILURE)


class QuietServer(uvicorn.Server):
    _loop: asyncio.AbstractEventLoop | None = None
    _exit_asked: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._exit_asked = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            # Each tick is a tenth of uvicorn's counter: its once-a-second work comes at every one.
            counter = (counter + 10) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_TICK_SECONDS):
                    await self._exit_asked.wait()
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._exit_asked is not None:
            self._loop.call_soon_threadsafe(self._exit_asked.set)


def serve(config: uvicorn.Config) -> None:
    """Run one server process until it is asked to stop (as `uvicorn.run` does with one worker)."""
    server = QuietServer(config)
    server.run()
    if not server.started:
        sys.exit(_STARTUP_FAILURE)
