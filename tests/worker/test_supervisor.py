"""The supervisor of `respool up`: real child processes, real signals."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import is_alive
from worker.supervisor import Supervisor


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


_DRIVER = """
import logging, sys
from worker.supervisor import Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s")
supervisor = Supervisor()
for name in ("first", "second"):
    supervisor.spawn(name, [sys.executable, "-c", sys.argv[1]], env={})
sys.exit(supervisor.wait())
"""
_SLEEPER = """
import os, signal, sys, time
def report(signum, frame):
    print(signal.Signals(signum).name)
    sys.exit(0)
for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, report)
print(os.getpid())
time.sleep(60)
"""


def _read_until_running(driver: subprocess.Popen[str]) -> list[int]:
    """The children's pids, read from the driver's output once it says it is waiting for signals."""
    assert driver.stdout is not None
    pids: dict[str, int] = {}
    is_waiting = False
    while len(pids) < 2 or not is_waiting:
        line = driver.stdout.readline()
        assert line, "the driver exited early"
        name, _, rest = line.strip().partition(" | ")
        if rest:
            pids[name] = int(rest)
        is_waiting = is_waiting or line.startswith("running 2 processes")
    return list(pids.values())


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda signum: signum.name
)
def test_signal_stops_every_child_and_exits_zero(signum: signal.Signals) -> None:
    """A signal to the supervisor's group (as Ctrl-C sends it) reaches each child only as SIGTERM; exit 0."""
    driver = subprocess.Popen(
        [*_python(_DRIVER), _SLEEPER],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own to signal, like a terminal's foreground job
    )
    pids = _read_until_running(driver)

    os.killpg(driver.pid, signum)

    assert driver.wait(timeout=10) == 0
    assert driver.stdout is not None
    with driver.stdout:
        received = [line for line in driver.stdout.read().splitlines() if " | SIG" in line]
    assert sorted(received) == ["first | SIGTERM", "second | SIGTERM"]
    assert [pid for pid in pids if is_alive(pid)] == []


def _ready_pipe(tmp_path: Path) -> Path:
    """A FIFO: the trigger child blocks reading it until the other child has written its pid."""
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    return fifo


def _trigger(fifo: Path, exit_code: str) -> list[str]:
    return _python(f"print(open({str(fifo)!r}).read(), flush=True); {exit_code}")


def _pid_from(output: io.BytesIO) -> int:
    """The pid that the trigger child relayed, from its `trigger | <pid>` line."""
    line = next(line for line in output.getvalue().splitlines() if line.startswith(b"trigger | "))
    return int(line.removeprefix(b"trigger | "))


@pytest.mark.parametrize(
    ("exit_code", "status"),
    [
        ("raise SystemExit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL),
    ],
)
def test_unexpected_exit_stops_the_rest_and_returns_its_status(
    exit_code: str, status: int, tmp_path: Path
) -> None:
    """When one child exits, wait() stops the others and returns that child's exit status."""
    fifo = _ready_pipe(tmp_path)
    output = io.BytesIO()
    supervisor = Supervisor(output=output)
    sleeper = f"import os, time; open({str(fifo)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    supervisor.spawn("sleeper", _python(sleeper), env={})
    supervisor.spawn("trigger", _trigger(fifo, exit_code), env={})

    assert supervisor.wait() == status
    assert not is_alive(_pid_from(output))


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    """A child that ignores SIGTERM is SIGKILLed once `grace_seconds` have passed."""
    fifo = _ready_pipe(tmp_path)
    output = io.BytesIO()
    supervisor = Supervisor(grace_seconds=0.2, output=output)
    stubborn = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(fifo)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    supervisor.spawn("stubborn", _python(stubborn), env={})
    supervisor.spawn("trigger", _trigger(fifo, "raise SystemExit(1)"), env={})

    assert supervisor.wait() == 1
    assert not is_alive(_pid_from(output))


def test_grandchildren_are_stopped_with_their_parent(tmp_path: Path) -> None:
    """What a child started in its process group (say, uvicorn's workers) is stopped with it."""
    fifo = _ready_pipe(tmp_path)
    output = io.BytesIO()
    supervisor = Supervisor(output=output)
    parent = (
        "import subprocess, sys, time; "
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(fifo)!r}, 'w').write(str(grandchild.pid)); time.sleep(60)"
    )
    supervisor.spawn("parent", _python(parent), env={})
    supervisor.spawn("trigger", _trigger(fifo, "raise SystemExit(2)"), env={})

    assert supervisor.wait() == 2
    assert not is_alive(_pid_from(output))


def test_output_lines_carry_the_child_name() -> None:
    """Each line a child prints reaches the supervisor's output prefixed with the child's name."""
    output = io.BytesIO()
    supervisor = Supervisor(output=output)
    supervisor.spawn("greeter", _python("print('hello'); print('world', end='')"), env={})

    assert supervisor.wait() == 0
    assert output.getvalue() == b"greeter | hello\ngreeter | world\n"
