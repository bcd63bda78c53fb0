"""The migrations (migrations/versions): they build the schema worker/postgres/models.py describes, and the
chain depth migration (0003) gives rows already stored their depth."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from alembic import command
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from tests.support.stack import Servers, fresh_database
from worker.postgres.migrate import alembic_config, migrate
from worker.postgres.store import async_url

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_database(backing: Servers) -> Iterator[str]:
    with fresh_database(backing.database_url, migrated=False) as url:
        yield url


def _upgrade(url: str, revision: str) -> None:
    engine = create_engine(async_url(url), poolclass=NullPool)
    with engine.begin() as conn:
        config = alembic_config(url)
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def test_the_migrations_build_the_schema_the_models_describe(empty_database: str) -> None:
    migrate(empty_database)
    engine = create_engine(async_url(empty_database), poolclass=NullPool)
    with engine.connect() as conn:
        config = alembic_config(empty_database)
        config.attributes["connection"] = conn
        command.check(config)  # raises if autogenerate finds a difference


def test_rows_already_stored_get_their_chain_depth(empty_database: str) -> None:
    """a <- b <- c is a chain (depths 0, 1, 2); e follows d, which is gone: it counts from itself."""
    _upgrade(empty_database, "0002")
    engine = create_engine(async_url(empty_database), poolclass=NullPool)
    rows = [("resp_a", None), ("resp_b", "resp_a"), ("resp_c", "resp_b"), ("resp_e", "resp_d")]
    with engine.begin() as conn:
        for response_id, previous in rows:
            conn.execute(
                text(
                    "INSERT INTO response (id, owner, status, model, background, store, stream, "
                    "previous_response_id, request, conversation, response) VALUES (:id, 'o', 'completed', "
                    "'m', false, true, false, :previous, '{}', '[]', '{}')"
                ),
                {"id": response_id, "previous": previous},
            )
    migrate(empty_database)
    with engine.connect() as conn:
        depths = {
            row.id: row.chain_depth for row in conn.execute(text("SELECT id, chain_depth FROM response"))
        }
    assert depths == {"resp_a": 0, "resp_b": 1, "resp_c": 2, "resp_e": 0}


class LateListener:
    """A local TCP port that refuses connections (bound, not listening) until `open()`; then it
    forwards each connection to the database at `target` (a Postgres still starting, then up)."""

    def __init__(self, target: str) -> None:
        self.target = make_url(target)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]

    def url(self) -> str:
        """`target`'s URL, through this port."""
        query = {key: value for key, value in self.target.query.items() if key not in ("host", "port")}
        moved = self.target.set(host="127.0.0.1", port=self.port, query=query)
        return moved.render_as_string(hide_password=False)

    def open(self) -> None:
        self.sock.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _connect(self) -> socket.socket:
        host = self.target.query.get("host") or self.target.host or "127.0.0.1"
        port = int(self.target.query.get("port") or self.target.port or 5432)
        if str(host).startswith("/"):  # a unix socket dir (the embedded Postgres)
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(f"{host}/.s.PGSQL.{port}")
            return upstream
        return socket.create_connection((str(host), port))

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = self._connect()
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _migrate(backing: Servers, database_url: str, **env: str) -> subprocess.Popen[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("RESPOOL_")}
    environment.update(RESPOOL_REDIS_URL=backing.redis_url, RESPOOL_DATABASE_URL=database_url, **env)
    return subprocess.Popen(
        [sys.executable, "-m", "api", "migrate"], env=environment, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.once
def test_migrate_waits_for_a_database_that_is_not_up_yet(backing: Servers, empty_database: str) -> None:
    """`respool migrate` started before Postgres accepts connections (compose's first start) retries,
    saying so, and migrates once it does."""
    listener = LateListener(empty_database)
    try:
        with _migrate(backing, listener.url()) as process:
            assert process.stderr is not None
            lines = [process.stderr.readline()]
            while "not reachable yet" not in lines[-1]:
                assert lines[-1], f"migrate ended without waiting: {lines}"
                lines.append(process.stderr.readline())
            listener.open()
            output = process.stderr.read()
        assert process.returncode == 0, output
    finally:
        listener.close()
    assert "migrated the database schema from revision (none) to" in output


@pytest.mark.once
def test_migrate_gives_up_on_a_database_that_never_comes(backing: Servers, empty_database: str) -> None:
    """The wait is bounded (RESPOOL_DATABASE_WAIT_SECONDS): then exit status 1, saying why."""
    listener = LateListener(empty_database)
    try:
        process = _migrate(backing, listener.url(), RESPOOL_DATABASE_WAIT_SECONDS="1")
        _, errors = process.communicate(timeout=60)
    finally:
        listener.close()
    assert process.returncode == 1
    assert "Postgres was not reachable within 1 s (RESPOOL_DATABASE_WAIT_SECONDS)" in errors
