"""Conversations and their items in Postgres (DESIGN.md §11).

Items are kept in the order they were added (`position`, from one sequence), each once per
conversation (`item_id` unique within it). Every read and write names the owner, or goes through a
conversation the caller has already found to be the owner's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from sqlalchemy import delete, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from worker.postgres import store
from worker.postgres.models import ConversationItemRow, ConversationRow


def shape(conversation_id: str, created_at: datetime, metadata: dict[str, Any]) -> dict[str, Any]:
    """The Conversation object (the SDK's `Conversation`)."""
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": int(created_at.timestamp()),
        "metadata": metadata,
    }


async def create(
    conn: AsyncConnection,
    conversation_id: str,
    owner: str,
    metadata: dict[str, str],
    items: list[dict[str, Any]],
) -> dict[str, Any]:
    """A new conversation with its first items (in the caller's transaction); its object."""
    row = await conn.execute(
        insert(ConversationRow)
        .values(id=conversation_id, owner=owner, metadata_=metadata)
        .returning(ConversationRow.created_at)
    )
    created_at = row.scalar_one()
    await add_items(conn, conversation_id, items)
    return shape(conversation_id, created_at, metadata)


async def get(
    conn: AsyncConnection, conversation_id: str, owner: str, *, lock: bool = False
) -> dict[str, Any] | None:
    """The owner's conversation, or None; `lock`: held (FOR SHARE) until the transaction ends, so it
    cannot be deleted under items being added."""
    query = select(
        ConversationRow.id, ConversationRow.created_at, ConversationRow.metadata_.label("meta")
    ).where(ConversationRow.id == conversation_id, ConversationRow.owner == owner)
    row = (await conn.execute(query.with_for_update(read=True) if lock else query)).one_or_none()
    return None if row is None else shape(row.id, row.created_at, row.meta)


async def update_metadata(
    conn: AsyncConnection, conversation_id: str, owner: str, metadata: dict[str, str]
) -> dict[str, Any] | None:
    row = (
        await conn.execute(
            update(ConversationRow)
            .where(ConversationRow.id == conversation_id, ConversationRow.owner == owner)
            .values(metadata_=metadata)
            .returning(ConversationRow.created_at)
        )
    ).one_or_none()
    return None if row is None else shape(conversation_id, row.created_at, metadata)


async def delete_conversation(conn: AsyncConnection, conversation_id: str, owner: str) -> bool:
    """Delete the conversation and (by cascade) its items; False if the owner has none such."""
    result = await conn.execute(
        delete(ConversationRow).where(ConversationRow.id == conversation_id, ConversationRow.owner == owner)
    )
    return result.rowcount == 1


async def add_items(
    conn: AsyncConnection, conversation_id: str, items: list[dict[str, Any]], response_id: str | None = None
) -> int:
    """Append `items` in order; an item whose id the conversation already holds is left as it is
    (so appending a response's items twice adds them once). How many were added."""
    if not items:
        return 0
    rows = [
        {
            "conversation_id": conversation_id,
            "item_id": str(item["id"]),
            "item": item,
            "response_id": response_id,
        }
        for item in items
    ]
    statement = (
        pg_insert(ConversationItemRow)
        .values(rows)
        .on_conflict_do_nothing(index_elements=["conversation_id", "item_id"])
    )
    return int((await conn.execute(statement)).rowcount)


async def append_response(
    conn: AsyncConnection, conversation_id: str, response_id: str, items: list[dict[str, Any]]
) -> int:
    """A finished response's items, appended to its conversation in the caller's transaction (the
    one that records its end): once, whatever retries (ids are unique per conversation); nothing if
    the conversation was deleted (its row is held meanwhile, so a delete waits for the commit)."""
    held = select(ConversationRow.id).where(ConversationRow.id == conversation_id).with_for_update(read=True)
    if (await conn.execute(held)).scalar_one_or_none() is None:
        return 0
    return await add_items(conn, conversation_id, items, response_id)


async def all_items(conn: AsyncConnection, conversation_id: str) -> list[dict[str, Any]]:
    """Every item, oldest first: what a response on the conversation is given before its input."""
    query = (
        select(ConversationItemRow.item)
        .where(ConversationItemRow.conversation_id == conversation_id)
        .order_by(ConversationItemRow.position)
    )
    return [dict(item) for item in (await conn.execute(query)).scalars()]


async def list_items(
    conn: AsyncConnection,
    conversation_id: str,
    *,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> tuple[list[dict[str, Any]], bool]:
    """A page of items after the item `after` (cursor pagination), and whether more follow."""
    scope = ConversationItemRow.conversation_id == conversation_id
    return await store.page_of_items(conn, ConversationItemRow, scope, after=after, limit=limit, order=order)


async def get_item(conn: AsyncConnection, conversation_id: str, item_id: str) -> dict[str, Any] | None:
    query = select(ConversationItemRow.item).where(
        ConversationItemRow.conversation_id == conversation_id, ConversationItemRow.item_id == item_id
    )
    item = (await conn.execute(query)).scalar_one_or_none()
    return None if item is None else dict(item)


async def delete_item(conn: AsyncConnection, conversation_id: str, item_id: str) -> bool:
    result = await conn.execute(
        delete(ConversationItemRow).where(
            ConversationItemRow.conversation_id == conversation_id, ConversationItemRow.item_id == item_id
        )
    )
    return result.rowcount == 1


async def holds_items(conn: AsyncConnection, conversation_id: str, item_ids: list[str]) -> list[str]:
    """Which of `item_ids` the conversation already holds."""
    if not item_ids:
        return []
    query = select(ConversationItemRow.item_id).where(
        ConversationItemRow.conversation_id == conversation_id, ConversationItemRow.item_id.in_(item_ids)
    )
    return list((await conn.execute(query)).scalars())
