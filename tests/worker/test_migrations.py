"""The migrations (migrations/versions): they build the schema worker/models.py describes, and the
chain depth migration (0003) gives rows already stored their depth."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic import command
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.support.stack import Servers, _fresh_database
from worker.migrate import alembic_config, migrate
from worker.store import async_url

pytestmark = pytest.mark.integration


@pytest.fixture
def empty_database(backing: Servers) -> Iterator[str]:
    url, drop = _fresh_database(backing.database_url)
    yield url
    drop()


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
