"""The processes a bench run starts: the paced upstream, respool's API and workers (and their Redis and
Postgres, embedded unless given), each a child that dies with the bench, logging to the run's dir."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx2

from api.up.processes import die_with_parent, terminate


class StartError(RuntimeError):
    """A process of the bench did not come up."""


class Children:
    """Every process the bench started, stopped in reverse order at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("ab")
        process = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE if name == "upstream" else log,
            stderr=log,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        self._processes.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        terminate(process, signal.SIGTERM)
        if process in self._processes:
            self._processes.remove(process)

    def stop_all(self) -> None:
        for process in reversed(self._processes):
            terminate(process, signal.SIGTERM)
        self._processes.clear()


def start_upstream(children: Children, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """The paced upstream (api/bench/upstream.py); its base URL ending in `/v1`."""
    argv = [sys.executable, "-m", "api.bench.upstream", "--port", "0"]
    process = children.spawn("upstream", argv, env)
    assert process.stdout is not None
    ready = select.select([process.stdout], [], [], 30)[0]
    line = process.stdout.readline().decode() if ready else ""
    if not line.startswith("LISTENING "):
        raise StartError(f"the bench upstream did not start (see {children.log_dir / 'upstream.log'})")
    return process, line.split()[1] + "/v1"


def start_api(
    children: Children, env: dict[str, str], port: int, name: str = "api"
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "api", "api", "--host", "127.0.0.1", "--port", str(port)]
    process = children.spawn(name, argv, env)
    url = f"http://127.0.0.1:{port}/readyz"
    wait_until(lambda: _answers(url), 60, f"respool's API on port {port}", process)
    return process


def start_worker(children: Children, env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
    """A worker, ready once its log (`<name>.log`, a new name for each start) says so."""
    process = children.spawn(name, [sys.executable, "-m", "api", "worker"], env)
    log = children.log_dir / f"{name}.log"
    wait_until(lambda: "ready: taking responses" in log.read_text(errors="replace"), 60, name, process)
    return process


def wait_until(
    check: Callable[[], bool], seconds: float, what: str, process: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if process.poll() is not None:
            raise StartError(f"{what} exited with status {process.returncode}; see its log")
        if time.monotonic() > deadline:
            raise StartError(f"{what} did not come up within {seconds:.0f} s; see its log")
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=2).status_code == 200
    except httpx2.HTTPError:
        return False
