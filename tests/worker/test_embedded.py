"""The embedded Redis and Postgres of `respool up`: real servers in temporary data dirs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from worker.embedded import EmbeddedPostgres, EmbeddedRedis

Server = EmbeddedRedis | EmbeddedPostgres
MARKER = "survives restarts"


def _redis_write(url: str) -> None:
    with redis.Redis.from_url(url) as client:
        client.set("marker", MARKER)


def _redis_read(url: str) -> str | None:
    with redis.Redis.from_url(url, decode_responses=True) as client:
        value: str | None = client.get("marker")
        return value


def _postgres_write(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE marker (value text)"))
        connection.execute(sa.text("INSERT INTO marker VALUES (:value)"), {"value": MARKER})
    engine.dispose()


def _postgres_read(url: str) -> str | None:
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        value: str | None = connection.execute(sa.text("SELECT value FROM marker")).scalar()
    engine.dispose()
    return value


@dataclass(frozen=True)
class Kind:
    start: Callable[[Path], Server]
    write: Callable[[str], None]
    read: Callable[[str], str | None]
    subdir: str


KINDS = [
    pytest.param(Kind(EmbeddedRedis.start, _redis_write, _redis_read, "redis"), id="redis"),
    pytest.param(Kind(EmbeddedPostgres.start, _postgres_write, _postgres_read, "postgres"), id="postgres"),
]


def _is_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie counts as gone, since this machine's PID 1 may never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _processes_in(directory: Path) -> list[int]:
    """Live processes whose working directory is `directory` (both servers chdir into theirs)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(entry / "cwd")) == directory.resolve():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("kind", KINDS)
def test_data_survives_stop_and_start(kind: Kind, tmp_path: Path) -> None:
    """Data written before stop() is there after start() on the same, socket-unfriendly long, data dir."""
    data_dir = tmp_path / ("long-" * 15) / ("path-" * 15)
    server = kind.start(data_dir)
    kind.write(server.url)
    server.stop()
    assert not _is_alive(server.process.pid)
    assert _processes_in(data_dir / kind.subdir) == []

    again = kind.start(data_dir)
    try:
        assert kind.read(again.url) == MARKER
    finally:
        again.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_start_after_the_server_was_killed(kind: Kind, tmp_path: Path) -> None:
    """A server SIGKILLed mid-run (stale pidfile, orphaned backends) restarts with its committed data."""
    killed = kind.start(tmp_path)
    kind.write(killed.url)
    os.kill(killed.process.pid, signal.SIGKILL)

    again = kind.start(tmp_path)
    try:
        assert kind.read(again.url) == MARKER
    finally:
        again.stop()
        killed.stop()
    assert _processes_in(tmp_path / kind.subdir) == []


@pytest.mark.parametrize("kind", KINDS)
def test_start_replaces_a_server_left_running(kind: Kind, tmp_path: Path) -> None:
    """start() on a data dir whose server still runs stops that one cleanly and serves the same data."""
    left_running = kind.start(tmp_path)
    kind.write(left_running.url)

    replacement = kind.start(tmp_path)
    try:
        assert not _is_alive(left_running.process.pid)
        assert kind.read(replacement.url) == MARKER
    finally:
        replacement.stop()
        left_running.stop()


def test_redis_keeps_its_url_across_restarts(tmp_path: Path) -> None:
    """Redis comes back on the port it had, so a URL noted down earlier still works."""
    first = EmbeddedRedis.start(tmp_path)
    first.stop()
    second = EmbeddedRedis.start(tmp_path)
    second.stop()
    assert second.url == first.url


def test_postgres_is_reachable_only_through_its_socket(tmp_path: Path) -> None:
    """The URL names a private socket dir and the server listens on no TCP address."""
    server = EmbeddedPostgres.start(tmp_path)
    try:
        engine = sa.create_engine(server.url)
        with engine.connect() as connection:
            listen = connection.execute(sa.text("SHOW listen_addresses")).scalar()
        engine.dispose()
        assert listen == ""
        assert server.socket_dir.stat().st_mode & 0o077 == 0
    finally:
        server.stop()
    assert not server.socket_dir.exists()


_PARENT = """
import json, sys, time
from pathlib import Path
from worker.embedded import EmbeddedPostgres, EmbeddedRedis

servers = [EmbeddedRedis.start(Path(sys.argv[1])), EmbeddedPostgres.start(Path(sys.argv[1]))]
print(json.dumps([[server.url, server.process.pid] for server in servers]), flush=True)
time.sleep(60)
"""


def test_servers_stop_when_their_parent_is_killed(tmp_path: Path) -> None:
    """After `kill -9` of their parent both servers exit, then restart with their data and tidy up."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    (redis_url, redis_pid), (postgres_url, postgres_pid) = json.loads(parent.stdout.readline())
    _redis_write(redis_url)
    _postgres_write(postgres_url)

    parent.kill()
    parent.wait()
    parent.stdout.close()
    assert _wait_until(lambda: not _is_alive(redis_pid) and not _is_alive(postgres_pid))

    redis_again, postgres_again = EmbeddedRedis.start(tmp_path), EmbeddedPostgres.start(tmp_path)
    try:
        assert _redis_read(redis_again.url) == MARKER
        assert _postgres_read(postgres_again.url) == MARKER
        assert not Path(sa.make_url(postgres_url).query["host"]).exists()  # the old socket dir
    finally:
        redis_again.stop()
        postgres_again.stop()
