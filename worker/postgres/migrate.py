"""Running the Alembic migrations (`respool migrate`, and `respool up` before it starts anything)."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, create_engine, text

from worker.outages import patiently_sync
from worker.postgres.store import async_url

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"
# Concurrent `migrate` runs (several replicas starting at once) take turns on this lock.
LOCK_ID = 0x7265_7370_6F6F_6C

log = logging.getLogger("respool.migrate")


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # psycopg 3 serves both the async engine and Alembic's sync one under the same URL.
    config.set_main_option("sqlalchemy.url", async_url(database_url).replace("%", "%%"))
    return config


def migrate(database_url: str, wait_seconds: float = 0.0) -> None:
    """Bring the schema to the newest revision, waiting up to `wait_seconds` for Postgres to be
    reachable (a container started beside a database still starting up: compose's first start).

    The migrations, the lock that has concurrent runs take turns and the revision read run in one
    transaction, the lock a transaction's own (`pg_advisory_xact_lock`): behind a transaction
    pooler a session's lock would be taken and given back on server connections of its choosing.
    No statement is prepared, for the same reason (psycopg prepares a query run 5 times)."""
    engine = create_engine(async_url(database_url), connect_args={"prepare_threshold": None})
    with patiently_sync(engine.connect, wait_seconds) as conn, conn.begin():
        conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": LOCK_ID})
        before = _revision(conn)
        config = alembic_config(database_url)
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
        after = _revision(conn)
    if before == after:
        log.info("the database schema is up to date (revision %s)", after)
    else:
        log.info("migrated the database schema from revision %s to %s", before or "(none)", after)
    engine.dispose()


def _revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()
