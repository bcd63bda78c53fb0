"""Process helpers for `respool up` (its supervisor and embedded servers) and the benchmark: children
that die with their parent, exit statuses in words, stopping a process and what a dead run left.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

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


def describe_exit(returncode: int) -> str:
    """How a process ended, in words: "status 3", "killed by SIGKILL"."""
    if returncode >= 0:
        return f"status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


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
