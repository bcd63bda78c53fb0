"""The keys the servers share through Postgres (`server_key`): made once, by whichever process asks
first, and the same for every process after."""

from __future__ import annotations

from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from worker.postgres.models import ServerKeyRow
from worker.protocol.compaction import Sealer, new_secret


async def shared_key(engine: AsyncEngine, name: str, fresh: str) -> str:
    """The key `name`; `fresh` becomes it if there is none yet (two processes asking at once get the
    same one)."""
    async with engine.begin() as conn:
        await conn.execute(insert(ServerKeyRow).values(name=name, value=fresh).on_conflict_do_nothing())
        row = select(ServerKeyRow.value).where(ServerKeyRow.name == name)
        value = (await conn.execute(row)).scalar_one()
    return str(value)


async def compaction_sealer(engine: AsyncEngine, configured: SecretStr | None) -> Sealer:
    """The sealer of respool's compaction items: the configured keys (RESPOOL_COMPACTION_KEYS,
    comma-separated), else the one kept in Postgres, made on first use."""
    if configured is not None:
        secrets = [key.strip() for key in configured.get_secret_value().split(",") if key.strip()]
        if secrets:
            return Sealer(secrets)
    return Sealer([await shared_key(engine, "compaction", new_secret())])
