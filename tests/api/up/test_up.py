"""`respool up`, as a user runs it: everything on one machine, Ctrl-C stops it all, data persists."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis import Redis
from rq import Worker

from api.up.embedded import redis_server
from api.up.processes import processes_of
from tests.conftest import make_sdk
from tests.support.faults import check_ended, lease_holders, wait_until_ended
from tests.support.lab import has_output
from tests.support.stack import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.once]  # its own embedded servers

# The console script `uv run respool` runs: the README's first command, as a user types it.
RESPOOL = str(Path(sys.executable).with_name("respool"))
# A synthetic reply of 31 words (its preamble, then these quoted back); at 0.15 s a word, about 5 s.
WORDS = " ".join(f"word{n}" for n in range(25))
SLOW = {"RESPOOL_SYNTHETIC_DELAY_SECONDS": "0.15"}


def _processes_using(path: Path) -> list[int]:
    """Pids whose command line or working directory mentions `path`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(path) in cmdline or cwd.startswith(str(path)):
            found.append(int(entry.name))
    return found


def _api_replicas(path: Path) -> list[int]:
    """The API processes uvicorn's manager spawned for `respool up --api-replicas`."""
    return [
        pid for pid in _processes_using(path) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def _none_left(path: Path, timeout: float) -> None:
    """Wait until no process uses `path`; else fail naming those left."""
    try:
        wait_for(lambda: not _processes_using(path), timeout=timeout, what="no process left")
    except AssertionError:
        left = {
            pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            for pid in _processes_using(path)
        }
        raise AssertionError(f"processes left after {timeout} s: {left}") from None


def _up(
    data_dir: Path, port: int, *, api_replicas: int = 2, console: Path | None = None, **env: str
) -> subprocess.Popen[bytes]:
    """`respool up` with two workers on `data_dir`, its console piped (or written to `console`)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("RESPOOL_")}
    environment.update(RESPOOL_DATA_DIR=str(data_dir), **env)
    argv = [RESPOOL, "up", "--port", str(port), "--workers", "2", "--api-replicas", str(api_replicas)]
    if console is None:
        return subprocess.Popen(
            argv, env=environment, cwd=data_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    with console.open("ab") as out:
        return subprocess.Popen(argv, env=environment, cwd=data_dir, stdout=out, stderr=subprocess.STDOUT)


def _listening(url: str, process: subprocess.Popen[bytes]) -> bool:
    assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _workers(path: Path) -> set[int]:
    """The worker processes `respool up` runs in `path`."""
    return {
        pid for pid in _processes_using(path) if b"api\x00worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    }


def _embedded_redis(data_dir: Path) -> Redis:
    port = re.search(r"^port (\d+)$", (data_dir / "redis" / "redis.conf").read_text(), re.MULTILINE)
    assert port is not None
    return Redis(port=int(port[1]))


def _busiest_worker(redis: Redis, response_ids: list[str]) -> int:
    """The pid of the worker holding the most of the responses' leases (once some are held)."""
    holders = wait_for(lambda: [h for h in lease_holders(redis, response_ids).values() if h], what="leases")
    name = max(set(holders), key=holders.count)
    return next(worker.pid for worker in Worker.all(connection=redis) if worker.name == name)


def _interrupt(process: subprocess.Popen[bytes]) -> str:
    process.send_signal(signal.SIGINT)  # what Ctrl-C sends
    output, _ = process.communicate(timeout=60)
    return (output or b"").decode(errors="replace")


def test_up_serves_stops_cleanly_and_keeps_data(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """`respool up` (two API processes, two workers) serves the SDK with no upstream, Ctrl-C leaves no
    process, and a restart keeps the data."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = _up(tmp_path, port)
    wait_for(lambda: _listening(url, process), timeout=90, what="respool up to listen")
    client = make_sdk(url, "unused")
    request.addfinalizer(client.close)
    assert len(_api_replicas(tmp_path)) == 2
    created = client.responses.create(model="synthetic", input="keep me", background=True)
    done = wait_for(lambda: (r := client.responses.retrieve(created.id)).status == "completed" and r)
    # By default the synthetic model says its words 20 ms apart, so a first stream is seen to stream:
    # its 31 words come in many deltas, the last no sooner than 31 pauses after the request.
    sent = time.monotonic()
    stream = client.responses.create(model="synthetic", input=WORDS, stream=True)
    arrivals = [time.monotonic() for event in stream if event.type == "response.output_text.delta"]
    assert len(arrivals) > 1 and arrivals[-1] - sent >= 31 * 0.02
    output = _interrupt(process)
    assert "client.responses.create" in output  # the copy-paste SDK example
    assert process.returncode == 0, output
    # A quiet console (RESPOOL_LOG_LEVEL=info): where it listens, the workers ready, a line a request,
    # the migration in one line; none of RQ's lines (its registry cleaning every 2 s, three a job)
    # nor Alembic's set-up lines.
    for expected in (
        "migrated the database schema",
        "ready: taking responses",
        "Uvicorn running on",
        "POST /v1/responses",
    ):
        assert expected in output, expected
    assert " rq." not in output and " alembic." not in output, output
    _none_left(tmp_path, timeout=10)

    process = _up(tmp_path, port)
    wait_for(lambda: _listening(url, process), timeout=90, what="respool up to listen again")
    assert client.responses.retrieve(created.id).output_text == done.output_text
    _interrupt(process)
    _none_left(tmp_path, timeout=10)


@pytest.mark.faults
def test_a_killed_worker_is_started_again_and_every_response_ends(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """kill -9 of one of `respool up`'s two workers with 50 background responses in flight: the API
    answers throughout, a new worker takes the dead one's place, every response completes (no client
    saw the dead worker's output, so it ran again) and every stream replays whole. Then kill -9 of
    the embedded Redis: that stops everything, saying so."""
    port, console = free_port(), tmp_path / "console.log"
    url = f"http://127.0.0.1:{port}"
    process = _up(tmp_path, port, api_replicas=1, console=console, **SLOW)
    request.addfinalizer(lambda: process.poll() is None and _interrupt(process))
    wait_for(lambda: _listening(url, process), timeout=90, what="respool up to listen")
    wait_for(lambda: len(_workers(tmp_path)) == 2, timeout=60, what="two workers")
    client = make_sdk(url, "unused")
    request.addfinalizer(client.close)
    redis = _embedded_redis(tmp_path)
    request.addfinalizer(redis.close)

    created = [client.responses.create(model="synthetic", input=WORDS, background=True).id for _ in range(50)]
    victim = _busiest_worker(redis, created)
    os.kill(victim, signal.SIGKILL)

    statuses = wait_until_ended(client, created, timeout=120)  # every poll answered, or this raises
    assert set(statuses.values()) == {"completed"}
    for response_id in created:
        stored = check_ended(client, response_id)
        assert stored["output"][0]["content"][0]["text"].endswith(f'"{WORDS}"')
    replaced = wait_for(lambda: len(workers := _workers(tmp_path)) == 2 and victim not in workers, timeout=30)
    assert replaced
    assert "exited unexpectedly (killed by SIGKILL); starting it again in 1 s" in console.read_text()

    # The embedded Redis is not a process respool up can do without: its death stops everything.
    # (The Redis `up` runs: the machine's, whose binary may be a link, as Debian's to redis-check-rdb.)
    (redis_pid,) = processes_of(redis_server().process_name, tmp_path / "redis")
    os.kill(redis_pid, signal.SIGKILL)
    assert process.wait(timeout=60) == 1
    said = "the embedded Redis exited (killed by SIGKILL); respool cannot run without it; stopping everything"
    assert said in console.read_text()
    _none_left(tmp_path, timeout=30)


@pytest.mark.faults
def test_responses_in_flight_when_up_is_killed_complete_after_a_restart(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """kill -9 of `respool up` itself with 10 slow background responses in flight, then `respool up`
    again on the same data dir: all 10 complete, run again from the start, since nobody saw their output."""
    port, console = free_port(), tmp_path / "console.log"
    url = f"http://127.0.0.1:{port}"
    process = _up(tmp_path, port, api_replicas=1, console=console, **SLOW)
    wait_for(lambda: _listening(url, process), timeout=90, what="respool up to listen")
    client = make_sdk(url, "unused")
    request.addfinalizer(client.close)
    created = [client.responses.create(model="synthetic", input=WORDS, background=True).id for _ in range(10)]
    with _embedded_redis(tmp_path) as redis:
        wait_for(
            lambda: all(has_output(redis, rid) for rid in created), timeout=30, what="output from all ten"
        )

    process.kill()
    process.wait()
    _none_left(tmp_path, timeout=60)
    process = _up(tmp_path, port, api_replicas=1, console=console, **SLOW)
    request.addfinalizer(lambda: process.poll() is None and _interrupt(process))
    wait_for(lambda: _listening(url, process), timeout=90, what="respool up to listen again")

    assert set(wait_until_ended(client, created, timeout=120).values()) == {"completed"}
    for response_id in created:
        check_ended(client, response_id)
    assert console.read_text().count("starts over (no client saw the output so far)") == 10
