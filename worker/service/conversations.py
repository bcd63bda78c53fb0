"""The Conversations API (DESIGN.md §11, PROTOCOL.md §8): conversations and their items, per owner.

Another owner's conversation, or one that does not exist, is a 404 on every route. Items are
normalized as a create's `input` is (each gets an id and a type; what each type requires is
checked); whether a model's upstream can be sent them is checked when a response uses them. An item
id the conversation already holds is a 400 naming it (ids are unique within a conversation).
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from worker.errors import ConversationItemNotFoundError, ConversationNotFoundError, InvalidRequestError
from worker.ids import new_id
from worker.postgres import conversations as rows
from worker.protocol import conversations as protocol
from worker.protocol.items import page


class ConversationService:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def create(self, owner: str, body: object) -> dict[str, Any]:
        items, metadata = protocol.parse_create(body)
        async with self.engine.begin() as conn:
            return await rows.create(conn, new_id("conv"), owner, metadata, items)

    async def retrieve(self, owner: str, conversation_id: str) -> dict[str, Any]:
        async with self.engine.connect() as conn:
            return await _owned(conn, conversation_id, owner)

    async def update(self, owner: str, conversation_id: str, body: object) -> dict[str, Any]:
        metadata = protocol.parse_update(body)
        async with self.engine.begin() as conn:
            updated = await rows.update_metadata(conn, conversation_id, owner, metadata)
        if updated is None:
            raise ConversationNotFoundError(conversation_id)
        return updated

    async def delete(self, owner: str, conversation_id: str) -> dict[str, Any]:
        async with self.engine.begin() as conn:
            if not await rows.delete_conversation(conn, conversation_id, owner):
                raise ConversationNotFoundError(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def add_items(self, owner: str, conversation_id: str, body: object) -> dict[str, Any]:
        """Append items; the page of the items added (the SDK's `ConversationItemList`)."""
        items = protocol.parse_items(body)
        async with self.engine.begin() as conn:
            await _owned(conn, conversation_id, owner, lock=True)
            held = await rows.holds_items(conn, conversation_id, [str(item["id"]) for item in items])
            if held:
                index = next(i for i, item in enumerate(items) if item["id"] in held)
                raise InvalidRequestError(
                    f"The conversation already holds an item with id '{held[0]}'.", param=f"items[{index}].id"
                )
            await rows.add_items(conn, conversation_id, items)
        return page(items, has_more=False)

    async def list_items(
        self, owner: str, conversation_id: str, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> dict[str, Any]:
        async with self.engine.connect() as conn:
            await _owned(conn, conversation_id, owner)
            items, has_more = await rows.list_items(
                conn, conversation_id, after=after, limit=limit, order=order
            )
        return page(items, has_more=has_more)

    async def get_item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        async with self.engine.connect() as conn:
            await _owned(conn, conversation_id, owner)
            item = await rows.get_item(conn, conversation_id, item_id)
        if item is None:
            raise ConversationItemNotFoundError(item_id)
        return item

    async def delete_item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        """Delete one item; the Conversation (as the SDK has it)."""
        async with self.engine.begin() as conn:
            conversation = await _owned(conn, conversation_id, owner)
            if not await rows.delete_item(conn, conversation_id, item_id):
                raise ConversationItemNotFoundError(item_id)
        return conversation


async def _owned(
    conn: AsyncConnection, conversation_id: str, owner: str, *, lock: bool = False
) -> dict[str, Any]:
    conversation = await rows.get(conn, conversation_id, owner, lock=lock)
    if conversation is None:
        raise ConversationNotFoundError(conversation_id)
    return conversation
