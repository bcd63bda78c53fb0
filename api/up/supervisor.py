"""The child processes of `respool up`. `Supervisor` starts the API and worker processes and keeps
them running as compose and Kubernetes keep containers running: a child that exits is started again
with backoff, the others serving on meanwhile. Only a child that keeps dying (a crash loop) or the
death of a process it cannot do without (an embedded Redis or Postgres, which it watches but never
restarts) stops everything, saying which and why; so do Ctrl-C, SIGTERM and SIGHUP.

Why each child gets its own session (`start_new_session=True`): Ctrl-C makes the terminal send
SIGINT to the whole foreground process group. If the children shared the supervisor's group they
would all be interrupted at once, in no particular order, while the supervisor is still deciding
what to do. In their own sessions only the supervisor hears the terminal; it then sends SIGTERM
to each child's whole process group (so a child's own children, such as uvicorn workers, hear it
too), waits up to `grace_seconds`, and SIGKILLs whatever is left. A child that dies on its own takes
its group with it (SIGKILL, as a container runtime kills what a dead container's main process left),
so a restarted API never meets its predecessor's uvicorn workers still holding the port.

On Linux every child also gets SIGTERM from the kernel if the supervisor dies abruptly
(`kill -9`), via `api.up.processes.die_with_parent`, so no process outlives `respool up`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, BinaryIO

from api.up.processes import describe_exit, die_with_parent, exit_status

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_Handler = Callable[[int, FrameType | None], object] | int | None  # what signal.signal() returns
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited starts again: after `first_delay_seconds`, doubling with each death
    within `crash_loop_seconds` up to `max_delay_seconds`; the `crash_loop_deaths`-th death within
    that window is a crash loop, which stops everything."""

    first_delay_seconds: float = 1.0
    max_delay_seconds: float = 30.0
    crash_loop_deaths: int = 5
    crash_loop_seconds: float = 60.0

    def delay(self, recent_deaths: int) -> float:
        """Seconds before the start that follows the `recent_deaths`-th recent death (from 1)."""
        return min(self.max_delay_seconds, self.first_delay_seconds * 2.0 ** min(recent_deaths - 1, 32))


@dataclass
class _Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None  # None while it waits to start again
    pump: threading.Thread | None = None
    deaths: deque[float] = field(default_factory=deque)  # when it exited, recently (monotonic)
    restart_at: float | None = None

    def has_exited(self) -> bool:
        """Whether the running process has exited, *without* reaping it.

        Leaving the zombie in place keeps its pid, and so its process-group id, from being reused
        until we have swept the group with SIGKILL.
        """
        if self.process is None or self.process.returncode is not None:
            return self.process is not None
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the child and everything it started in its process group."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def reap(self) -> int:
        """Kill what the exited process left in its group, reap it; its return code."""
        assert self.process is not None
        self.signal_group(signal.SIGKILL)  # its unreaped zombie still holds the group id
        returncode = self.process.wait()
        if self.pump is not None:
            self.pump.join(timeout=1.0)
        return returncode


@dataclass(frozen=True)
class _Stop:
    """Why everything stops on its own: what to say, and the exit status of `respool up`."""

    reason: str
    status: int


class _SignalWatch:
    """Installs handlers that record stop signals and wake `sleep()` on those and on SIGCHLD.

    The wakeup fd turns signals into bytes on a socket, so waiting is a plain `select` with no
    polling and no race: a signal that lands before `select` still leaves its byte behind.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._reader, self._writer = socket.socketpair()
        self._previous: dict[int, _Handler] = {}
        self._previous_fd = -1

    def __enter__(self) -> _SignalWatch:
        for sock in (self._reader, self._writer):
            sock.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        # A Python-level SIGCHLD handler is what makes the kernel's SIGCHLD reach the wakeup fd.
        self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda _s, _f: None)
        return self

    def __exit__(self, *_exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._reader.close()
        self._writer.close()

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)

    def sleep(self, timeout: float | None = None) -> None:
        """Block until some signal arrives (or already has since the last call), at most `timeout` s."""
        select.select([self._reader], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while self._reader.recv(4096):
                pass


def _stdout_buffer() -> BinaryIO:
    return sys.stdout.buffer


@dataclass
class Supervisor:
    """Runs named child processes, starting each again when it exits, until a stop signal, a crash
    loop, or the exit of a watched process."""

    grace_seconds: float = 10.0
    output: BinaryIO = field(default_factory=_stdout_buffer, repr=False)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    _children: list[_Child] = field(default_factory=list, init=False, repr=False)
    _watched: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list, init=False, repr=False)
    _output_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """Start `argv` in its own session; its output goes to `output`, each line prefixed `name | `.
        Started again whenever it exits (`restart`)."""
        child = _Child(name, argv, env)
        self._start(child)
        self._children.append(child)

    def watch(self, name: str, process: subprocess.Popen[bytes]) -> None:
        """Stop everything if `process` (started elsewhere, never restarted here) exits."""
        self._watched.append((name, process))

    def wait(self) -> int:
        """Keep the children running until a stop signal, a crash loop or a watched process's exit;
        then stop everything and return an exit status.

        0 after SIGINT/SIGTERM/SIGHUP; after a crash loop the exit status of the child that kept
        dying (1 if that was 0); 1 after a watched process's exit. A second signal while stopping
        skips the grace period. Call it from the main thread.
        """
        with _SignalWatch() as watch:
            logger.info("running %d processes; press Ctrl-C to stop", len(self._children))
            stop = self._tend()
            while stop is None and not watch.received:
                watch.sleep(self._until_next_start())
                stop = self._tend()
            if stop is not None:
                logger.error("%s; stopping everything", stop.reason)
            else:
                logger.info("received %s; stopping", signal.Signals(watch.received[0]).name)
            self._stop(is_forced=lambda: len(watch.received) > 1)
        return 0 if stop is None else stop.status

    def stop(self) -> None:
        """SIGTERM every child's process group, wait up to `grace_seconds`, SIGKILL the rest, reap.

        Idempotent; for a `finally` when `wait()` was never reached.
        """
        self._stop(is_forced=lambda: False)

    def _start(self, child: _Child) -> None:
        child.restart_at = None
        child.process = subprocess.Popen(
            child.argv,
            # Children write to a pipe, not a terminal; unbuffered keeps their lines in time order.
            env={"PYTHONUNBUFFERED": "1", **child.env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        assert child.process.stdout is not None  # stdout=PIPE
        child.pump = threading.Thread(
            target=self._copy_lines,
            args=(child.name, child.process.stdout),
            name=f"output-{child.name}",
            daemon=True,
        )
        child.pump.start()
        logger.info("started %s (pid %d)", child.name, child.process.pid)

    def _tend(self) -> _Stop | None:
        """Note every exit since the last look: schedule restarts, start what is due; or why to stop."""
        for name, process in self._watched:
            if process.poll() is not None:
                reason = f"{name} exited ({describe_exit(process.returncode)}); respool cannot run without it"
                return _Stop(reason, 1)
        now = time.monotonic()
        for child in self._children:
            if child.has_exited():
                stop = self._on_exit(child, now)
                if stop is not None:
                    return stop
            if child.process is None and child.restart_at is not None and now >= child.restart_at:
                self._start(child)
        return None

    def _on_exit(self, child: _Child, now: float) -> _Stop | None:
        assert child.process is not None
        pid, returncode = child.process.pid, child.reap()
        child.process = None
        child.deaths.append(now)
        while child.deaths and child.deaths[0] < now - self.restart.crash_loop_seconds:
            child.deaths.popleft()
        how = describe_exit(returncode)
        if len(child.deaths) >= self.restart.crash_loop_deaths:
            reason = (
                f"{child.name} exited {len(child.deaths)} times within "
                f"{self.restart.crash_loop_seconds:g} s (the last time: {how})"
            )
            return _Stop(reason, exit_status(returncode) or 1)
        delay = self.restart.delay(len(child.deaths))
        child.restart_at = now + delay
        logger.warning(
            "%s (pid %d) exited unexpectedly (%s); starting it again in %g s", child.name, pid, how, delay
        )
        return None

    def _until_next_start(self) -> float | None:
        """Seconds until the next restart is due; None: none is (wait for a signal)."""
        due = [child.restart_at for child in self._children if child.restart_at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _stop(self, is_forced: Callable[[], bool]) -> None:
        running = [child for child in self._children if child.process is not None and not child.has_exited()]
        for child in running:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while any(not c.has_exited() for c in running) and time.monotonic() < deadline and not is_forced():
            time.sleep(_POLL_SECONDS)
        for child in self._children:
            if child.process is None:
                continue
            # Also sweeps what a child left behind in its group; the child's unreaped zombie
            # still holds the group id, so this cannot hit an unrelated process.
            returncode = child.reap()
            logger.info("%s exited with status %d", child.name, exit_status(returncode))
            child.process = None
        self._children.clear()

    def _copy_lines(self, name: str, stream: IO[bytes]) -> None:
        prefix = f"{name} | ".encode()
        with stream:
            for line in iter(stream.readline, b""):
                ending = b"" if line.endswith(b"\n") else b"\n"
                with self._output_lock, contextlib.suppress(OSError):
                    # Keep draining even if our own stdout is gone, so a child never blocks on a
                    # full pipe.
                    self.output.write(prefix + line + ending)
                    self.output.flush()
