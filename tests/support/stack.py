"""Real respool processes for integration tests: `respool api` and `respool worker`, on real servers.

The servers are the ones `RESPOOL_REDIS_URL` / `RESPOOL_DATABASE_URL` name (CI's second pass uses
the machine's Redis 7 and Postgres 15), or else embedded ones started for the session, exactly as
`respool up` starts them. Each session gets a database and a queue of its own.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

ROOT = Path(__file__).resolve().parents[2]
# Every stack's log folder, so that a failing test's report shows what its processes logged meanwhile
# (tests/conftest.py: pytest_runtest_makereport).
LOG_DIRS: list[Path] = []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for[T](
    check: Callable[[], T | None], timeout: float = 20.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll `check` until it returns something truthy, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or check}")
        time.sleep(interval)


WORKER_READY = "ready: taking responses"  # what a worker logs once it takes responses


@dataclass
class Servers:
    redis_url: str
    database_url: str


@contextmanager
def servers() -> Iterator[Servers]:
    """Redis and a fresh Postgres database for one test session."""
    stops: list[Callable[[], None]] = []
    try:
        redis_url = os.environ.get("RESPOOL_REDIS_URL", "")
        database_url = os.environ.get("RESPOOL_DATABASE_URL", "")
        if not redis_url or not database_url:
            from api.up.embedded import EmbeddedPostgres, EmbeddedRedis

            # Not under pytest's tmp dir: as root, Postgres runs as another user, and pytest resets
            # that tree to 0700 whenever another session starts.
            data_dir = Path(tempfile.mkdtemp(prefix="respool-test-"))
            stops.append(functools.partial(shutil.rmtree, data_dir, ignore_errors=True))
            redis = EmbeddedRedis.start(data_dir)
            postgres = EmbeddedPostgres.start(data_dir)
            stops += [redis.stop, postgres.stop]
            redis_url, database_url = redis.url, postgres.url
        database, drop = _fresh_database(database_url)
        stops.append(drop)
        yield Servers(redis_url, database)
    finally:
        for stop in reversed(stops):
            stop()


def rows_with_metadata(backing: Servers, marker: str) -> int:
    """How many response rows were recorded with `metadata: {"m": marker}` (nothing recorded: 0)."""
    engine = create_engine(backing.database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            query = text("SELECT count(*) FROM response WHERE request->'metadata'->>'m' = :m")
            return int(conn.execute(query, {"m": marker}).scalar_one())
    finally:
        engine.dispose()


@contextmanager
def fresh_database(url: str, *, migrated: bool = True) -> Iterator[str]:
    """A database of its own beside `url`'s (with respool's schema unless `migrated` is false),
    dropped afterwards: for tests that count its connections or rows, or migrate it themselves."""
    from worker.postgres.migrate import migrate

    database, drop = _fresh_database(url)
    try:
        if migrated:
            migrate(database)
        yield database
    finally:
        drop()


def _fresh_database(url: str) -> tuple[str, Callable[[], None]]:
    from worker.postgres.store import async_url

    name = f"respool_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(async_url(url), isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    return make_url(async_url(url)).set(database=name).render_as_string(hide_password=False), drop


@dataclass
class Stack:
    """A set of respool processes sharing one environment."""

    env: dict[str, str]
    logs: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    url: str = ""

    def __post_init__(self) -> None:
        LOG_DIRS.append(self.logs)

    def run(self, *args: str) -> None:
        """Run a one-shot `respool` command (e.g. `migrate`) to completion."""
        subprocess.run([sys.executable, "-m", "api", *args], env=self.env, cwd=ROOT, check=True, timeout=120)

    def start_api(self, name: str = "api") -> str:
        port = free_port()
        self._spawn(name, "api", "--host", "127.0.0.1", "--port", str(port))
        url = f"http://127.0.0.1:{port}"
        try:
            # 60 s, as a worker's start: three suites' processes on two cores have taken over 30.
            wait_for(lambda: _healthy(url, self.processes[name]), timeout=60, what=f"{name} to listen")
        except AssertionError as exc:
            self.stop(name)  # a fixture that fails here never reaches its stop_all: no process left behind
            tail = "\n".join(self.log(name).splitlines()[-20:])
            raise AssertionError(f"{exc}; the last lines of its log:\n{tail}") from None
        self.url = self.url or url
        return url

    def start_worker(
        self, name: str = "worker", *args: str, ready: bool = True, env: dict[str, str] | None = None
    ) -> None:
        """Start a worker (`env` over the stack's own); unless `ready` is false, wait until it takes
        responses (a first request sent earlier waits for its start, which a slow machine has taken
        11 s to make)."""
        log = self.logs / f"{name}.log"
        before = log.read_text(errors="replace").count(WORKER_READY) if log.exists() else 0
        self._spawn(name, "worker", *args, env=env)
        if ready:
            wait_for(lambda: self.log(name).count(WORKER_READY) > before, timeout=60, what=f"{name} ready")

    def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with (self.logs / f"{name}.log").open("ab") as log:  # the child keeps its own copy
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "api", *args],
                env={**self.env, **(env or {}), "PYTHONUNBUFFERED": "1"},  # its log survives a kill -9
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(sig)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")


@contextmanager
def running_stack(env: dict[str, str], logs: Path, *workers: str, migrate: bool = True) -> Iterator[Stack]:
    """A stack of an API and `workers` (one, "worker", if none is named) on `env`, its database
    migrated first unless `migrate` is false; every process stopped afterwards."""
    stack = Stack(env, logs)
    try:
        if migrate:
            stack.run("migrate")
        stack.start_api()
        for name in workers or ("worker",):
            stack.start_worker(name)
        yield stack
    finally:
        stack.stop_all()


def _healthy(url: str, process: subprocess.Popen[bytes]) -> bool:
    if process.poll() is not None:
        raise AssertionError(f"the process exited with {process.returncode} before it listened")
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
