"""The supervisor of `respool up`: real child processes, real signals. A child that exits is started
again with backoff while the others serve on; a crash loop or a watched process's exit stops all."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from api.up.supervisor import RestartPolicy, Supervisor
from tests.support.processes import is_alive
from tests.support.stack import wait_for


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


_DRIVER = """
import json, logging, sys
from api.up.supervisor import RestartPolicy, Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
config = json.loads(sys.argv[1])
supervisor = Supervisor(restart=RestartPolicy(**config.get("restart", {})))
for name, code in config["children"].items():
    supervisor.spawn(name, [sys.executable, "-c", code], env={})
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


Driver = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def driver() -> Iterator[Driver]:
    """Starts a supervisor in a process of its own (a group of its own to signal, like a terminal's
    foreground job), running children (name => Python code) under a restart policy; whatever is left
    of it is killed, and its output closed, after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(children: dict[str, str], **restart: float) -> subprocess.Popen[str]:
        config = json.dumps({"children": children, "restart": restart})
        process = subprocess.Popen(
            [*_python(_DRIVER), config],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _read_until(driver: subprocess.Popen[str], is_done: Callable[[list[str]], bool]) -> list[str]:
    """The driver's output lines, read until `is_done` says enough were."""
    assert driver.stdout is not None
    lines: list[str] = []
    while not is_done(lines):
        line = driver.stdout.readline()
        assert line, f"the driver exited early: {lines}"
        lines.append(line.rstrip("\n"))
    return lines


def _pids(lines: list[str], name: str) -> list[int]:
    """The pids a child printed, one a start, in order."""
    return [int(line.partition(" | ")[2]) for line in lines if line.startswith(f"{name} | ")]


def _read_until_running(driver: subprocess.Popen[str]) -> list[int]:
    """The children's pids, read from the driver's output once it says it is waiting for signals."""
    lines = _read_until(
        driver,
        lambda lines: (
            any(line.startswith("running 2 processes") for line in lines)
            and len([line for line in lines if " | " in line]) >= 2
        ),
    )
    return _pids(lines, "first") + _pids(lines, "second")


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda signum: signum.name
)
def test_signal_stops_every_child_and_exits_zero(signum: signal.Signals, driver: Driver) -> None:
    """A signal to the supervisor's group (as Ctrl-C sends it) reaches each child only as SIGTERM; exit 0."""
    supervisor = driver({"first": _SLEEPER, "second": _SLEEPER})
    pids = _read_until_running(supervisor)

    os.killpg(supervisor.pid, signum)

    assert supervisor.wait(timeout=10) == 0
    assert supervisor.stdout is not None
    received = [line for line in supervisor.stdout.read().splitlines() if " | SIG" in line]
    assert sorted(received) == ["first | SIGTERM", "second | SIGTERM"]
    assert [pid for pid in pids if is_alive(pid)] == []


# A child that prints its pid, then exits with the given code the first time it runs (the flag file
# not there yet) and serves on every later time.
_FLAKY = """
import os, sys, time
print(os.getpid(), flush=True)
flag = {flag!r}
if not os.path.exists(flag):
    open(flag, "w").close()
    {exit}
time.sleep(60)
"""
_STEADY = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"


@pytest.mark.parametrize(
    ("exit_code", "how"),
    [
        ("raise SystemExit(3)", "status 3"),
        ("os.kill(os.getpid(), 9)", "killed by SIGKILL"),
    ],
)
def test_a_child_that_exits_is_started_again_while_the_others_serve_on(
    tmp_path: Path, exit_code: str, how: str, driver: Driver
) -> None:
    """A child that dies (an exit status, or kill -9) is logged and started again after its backoff; its
    siblings keep their process; Ctrl-C later stops both."""
    flaky = _FLAKY.format(flag=str(tmp_path / "ran"), exit=exit_code)
    supervisor = driver({"steady": _STEADY, "flaky": flaky}, first_delay_seconds=0.2)
    lines = _read_until(
        supervisor, lambda lines: len(_pids(lines, "flaky")) == 2 and bool(_pids(lines, "steady"))
    )
    first, second = _pids(lines, "flaky")
    assert f"flaky (pid {first}) exited unexpectedly ({how}); starting it again in 0.2 s" in lines
    assert f"started flaky (pid {second})" in lines
    (steady,) = _pids(lines, "steady")
    assert is_alive(steady) and is_alive(second) and not is_alive(first)

    os.killpg(supervisor.pid, signal.SIGINT)

    assert supervisor.wait(timeout=10) == 0
    assert not is_alive(steady) and not is_alive(second)


def test_backoff_doubles_with_each_recent_death_up_to_its_cap() -> None:
    """1 s, 2 s, 4 s, ... up to 30 s by default: a child that keeps dying is not started in a tight loop."""
    policy = RestartPolicy()
    assert [policy.delay(deaths) for deaths in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_crash_loop_stops_everything_saying_which_and_why(caplog: pytest.LogCaptureFixture) -> None:
    """The child that keeps dying (here 3 times within the window) stops every other child; its status is returned."""
    output = io.BytesIO()
    supervisor = Supervisor(
        output=output, restart=RestartPolicy(first_delay_seconds=0.01, crash_loop_deaths=3)
    )
    supervisor.spawn("steady", _python(_STEADY), env={})
    supervisor.spawn("broken", _python("import sys; print('cannot start'); sys.exit(4)"), env={})

    with caplog.at_level(logging.INFO, logger="api.up.supervisor"):
        assert supervisor.wait() == 4

    (steady,) = _pids([line.decode() for line in output.getvalue().splitlines()], "steady")
    assert not is_alive(steady)
    assert output.getvalue().count(b"broken | cannot start") == 3
    assert (
        "broken exited 3 times within 60 s (the last time: status 4); stopping everything" in caplog.messages
    )


def test_a_watched_process_that_exits_stops_everything(caplog: pytest.LogCaptureFixture) -> None:
    """An embedded server's death is not survivable: everything stops, saying which one, with status 1."""
    output = io.BytesIO()
    supervisor = Supervisor(output=output)
    supervisor.spawn("steady", _python(_STEADY), env={})
    server = subprocess.Popen(_python("import time; time.sleep(0.5)"))
    supervisor.watch("the embedded Redis", server)

    with caplog.at_level(logging.INFO, logger="api.up.supervisor"):
        assert supervisor.wait() == 1

    (steady,) = _pids([line.decode() for line in output.getvalue().splitlines()], "steady")
    assert not is_alive(steady)
    expected = "the embedded Redis exited (status 0); respool cannot run without it; stopping everything"
    assert expected in caplog.messages


def test_a_dead_childs_own_children_die_with_it_before_it_starts_again(
    tmp_path: Path, driver: Driver
) -> None:
    """What a dead child started in its group (uvicorn's workers, say) is killed before the child
    starts again, so they never outlive it holding its port."""
    parent = f"""
import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
flag = {str(tmp_path / "ran")!r}
if not os.path.exists(flag):
    open(flag, "w").close()
    os.kill(os.getpid(), 9)
time.sleep(60)
"""
    supervisor = driver({"parent": parent}, first_delay_seconds=0.2)
    lines = _read_until(supervisor, lambda lines: len(_pids(lines, "parent")) == 2)
    first_grandchild, second_grandchild = _pids(lines, "parent")
    assert not is_alive(first_grandchild)
    assert is_alive(second_grandchild)
    os.killpg(supervisor.pid, signal.SIGTERM)
    assert supervisor.wait(timeout=10) == 0
    assert not is_alive(second_grandchild)


# Children that stop everything at their first exit, to see how everything is stopped.
ONCE = RestartPolicy(crash_loop_deaths=1)


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


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    """A child that ignores SIGTERM is SIGKILLed once `grace_seconds` have passed."""
    fifo = _ready_pipe(tmp_path)
    output = io.BytesIO()
    supervisor = Supervisor(grace_seconds=0.2, output=output, restart=ONCE)
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
    supervisor = Supervisor(output=output, restart=ONCE)
    parent = (
        "import subprocess, sys, time; "
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(fifo)!r}, 'w').write(str(grandchild.pid)); time.sleep(60)"
    )
    supervisor.spawn("parent", _python(parent), env={})
    supervisor.spawn("trigger", _trigger(fifo, "raise SystemExit(2)"), env={})

    assert supervisor.wait() == 2
    # Signalled with its group, it dies on its own time: under load, a few ms after its parent did.
    grandchild = _pid_from(output)
    wait_for(lambda: not is_alive(grandchild), timeout=10, what="the grandchild to be gone")


def test_output_lines_carry_the_child_name() -> None:
    """Each line a child prints reaches the supervisor's output prefixed with the child's name."""
    output = io.BytesIO()
    supervisor = Supervisor(output=output, restart=ONCE)
    supervisor.spawn("greeter", _python("print('hello'); print('world', end='')"), env={})

    assert supervisor.wait() == 1  # it stopped everything by exiting: never a success
    assert output.getvalue() == b"greeter | hello\ngreeter | world\n"
