"""The child processes of `respool up`. `Supervisor` starts the API and worker processes, waits,
and stops every one of them on Ctrl-C, SIGTERM or the first unexpected exit; the functions below
it are how `worker.embedded` runs and stops its servers.

Why each child gets its own session (`start_new_session=True`): Ctrl-C makes the terminal send
SIGINT to the whole foreground process group. If the children shared the supervisor's group they
would all be interrupted at once, in no particular order, while the supervisor is still deciding
what to do. In their own sessions only the supervisor hears the terminal; it then sends SIGTERM
to each child's whole process group (so a child's own children, such as uvicorn workers, hear it
too), waits up to `grace_seconds`, and SIGKILLs whatever is left.

On Linux every child also gets SIGTERM from the kernel if the supervisor dies abruptly
(`kill -9`), via `die_with_parent`, so no process outlives `respool up`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, BinaryIO

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_Handler = Callable[[int, FrameType | None], object] | int | None  # what signal.signal() returns
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_SECONDS = 0.05
_STOP_SECONDS = 30.0
_LEFTOVER_SECONDS = 10.0
_PROC = Path("/proc")


def die_with_parent(signum: int) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the kernel send `signum` to the child when this process dies.

    Linux only (None elsewhere). The kernel fires it when the *thread* that spawned the child
    exits, so spawn long-lived children from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent_pid = os.getpid()

    def arm() -> None:
        if prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The parent may have died between fork() and prctl(); then no signal would ever come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signum)

    return arm


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell exit status: death by signal N becomes 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    pump: threading.Thread

    def has_exited(self) -> bool:
        """Whether the child has exited, *without* reaping it.

        Leaving the zombie in place keeps its pid, and so its process-group id, from being reused
        until we have swept the group with SIGKILL.
        """
        if self.process.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def signal_group(self, signum: int) -> None:
        """Send `signum` to the child and everything it started in its process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)


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

    def sleep(self) -> None:
        """Block until some signal arrives (or already has since the last call)."""
        select.select([self._reader], [], [])
        with contextlib.suppress(BlockingIOError):
            while self._reader.recv(4096):
                pass


def _stdout_buffer() -> BinaryIO:
    return sys.stdout.buffer


@dataclass
class Supervisor:
    """Runs named child processes until a stop signal or the first unexpected exit."""

    grace_seconds: float = 10.0
    output: BinaryIO = field(default_factory=_stdout_buffer, repr=False)
    _children: list[_Child] = field(default_factory=list, init=False, repr=False)
    _output_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """Start `argv` in its own session; its output goes to `output`, each line prefixed `name | `."""
        process = subprocess.Popen(
            argv,
            # Children write to a pipe, not a terminal; unbuffered keeps their lines in time order.
            env={"PYTHONUNBUFFERED": "1", **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        assert process.stdout is not None  # stdout=PIPE
        pump = threading.Thread(
            target=self._copy_lines, args=(name, process.stdout), name=f"output-{name}", daemon=True
        )
        pump.start()
        self._children.append(_Child(name, process, pump))
        logger.info("started %s (pid %d)", name, process.pid)

    def wait(self) -> int:
        """Block until a stop signal or a child's exit, stop everything, and return an exit status.

        0 after SIGINT/SIGTERM/SIGHUP; otherwise the exit status of the child that exited first.
        A second signal while stopping skips the grace period. Call it from the main thread.
        """
        with _SignalWatch() as watch:
            logger.info("running %d processes; press Ctrl-C to stop", len(self._children))
            culprit = self._first_exited()
            while culprit is None and not watch.received:
                watch.sleep()
                culprit = self._first_exited()
            self._report(culprit, watch.received)
            self._stop(is_forced=lambda: len(watch.received) > 1)
        return 0 if culprit is None else exit_status(culprit.process.returncode)

    def stop(self) -> None:
        """SIGTERM every child's process group, wait up to `grace_seconds`, SIGKILL the rest, reap.

        Idempotent; for a `finally` when `wait()` was never reached.
        """
        self._stop(is_forced=lambda: False)

    def _stop(self, is_forced: Callable[[], bool]) -> None:
        running = [child for child in self._children if not child.has_exited()]
        for child in running:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while any(not c.has_exited() for c in running) and time.monotonic() < deadline and not is_forced():
            time.sleep(_POLL_SECONDS)
        for child in self._children:
            # Also sweeps what a child left behind in its group; the child's unreaped zombie
            # still holds the group id, so this cannot hit an unrelated process.
            child.signal_group(signal.SIGKILL)
            child.process.wait()
            child.pump.join(timeout=1.0)
            logger.info("%s exited with status %d", child.name, exit_status(child.process.returncode))
        self._children.clear()

    def _first_exited(self) -> _Child | None:
        return next((child for child in self._children if child.has_exited()), None)

    def _report(self, culprit: _Child | None, received: list[int]) -> None:
        if culprit is not None:
            logger.warning("%s exited unexpectedly; stopping everything", culprit.name)
        else:
            logger.info("received %s; stopping", signal.Signals(received[0]).name)

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


# Servers: see worker.embedded.


def terminate(process: subprocess.Popen[bytes], signum: int) -> None:
    """Send `signum`, wait up to 30 s, then SIGKILL; always reap. Idempotent."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored signal %d; killing it", process.pid, signum)
            process.kill()
    process.wait()


def processes_of(binary_name: str, cwd: Path) -> list[int]:
    """Live processes running binary `binary_name` in working directory `cwd` (none without /proc).

    A server chdirs into its data dir, so this finds one left running there and no other. Zombies
    have no cwd, so they never count.
    """
    pids = []
    for entry in _PROC.glob("[0-9]*"):
        try:
            exe, here = os.readlink(entry / "exe"), os.readlink(entry / "cwd")
        except OSError:  # gone meanwhile, a zombie, or not ours to inspect
            continue
        if Path(exe.removesuffix(" (deleted)")).name == binary_name and Path(here) == cwd:
            pids.append(int(entry.name))
    return pids


def stop_leftovers(binary_name: str, cwd: Path, signum: int, *, only: int | None = None) -> None:
    """Stop a server left running in `cwd`: `signum` to each process (or just `only`), then SIGKILL."""
    pids = processes_of(binary_name, cwd)
    if not pids:
        return
    logger.warning("stopping %s processes %s left running in %s", binary_name, pids, cwd)
    for pid in pids if only is None else [pid for pid in pids if pid == only]:
        _kill(pid, signum)
        _kill(pid, signal.SIGCONT)  # a suspended process would not act on `signum` until continued
    if _wait_for(lambda: not processes_of(binary_name, cwd), _LEFTOVER_SECONDS):
        return
    for pid in processes_of(binary_name, cwd):
        _kill(pid, signal.SIGKILL)
    _wait_for(lambda: not processes_of(binary_name, cwd), _LEFTOVER_SECONDS)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True
