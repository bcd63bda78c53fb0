"""The Conversations API (issue 18) through real processes, with the `openai` SDK as the client:
the lifecycle, cursor pagination, limits and errors, and owner isolation on every route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.integration


def said(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def test_the_lifecycle(client: openai.OpenAI) -> None:
    created = client.conversations.create(items=[said("hello"), said("again")], metadata={"topic": "demo"})  # type: ignore[list-item]
    assert created.id.startswith("conv_") and created.object == "conversation"
    assert created.metadata == {"topic": "demo"}
    assert client.conversations.retrieve(created.id) == created
    updated = client.conversations.update(created.id, metadata={"topic": "other"})
    assert (updated.id, updated.metadata, updated.created_at) == (
        created.id,
        {"topic": "other"},
        created.created_at,
    )
    added = client.conversations.items.create(created.id, items=[said("third"), said("fourth", "assistant")])  # type: ignore[list-item]
    assert [item.type for item in added.data] == ["message", "message"]
    assert added.first_id == added.data[0].id and added.last_id == added.data[1].id
    texts = [item.content[0].text for item in client.conversations.items.list(created.id, order="asc")]  # type: ignore[union-attr]
    assert texts == ["hello", "again", "third", "fourth"]
    newest = client.conversations.items.list(created.id)  # newest first by default
    assert [item.content[0].text for item in newest.data] == ["fourth", "third", "again", "hello"]  # type: ignore[union-attr]
    one = client.conversations.items.retrieve(added.data[0].id, conversation_id=created.id)
    assert one.id == added.data[0].id and one.content[0].text == "third"  # type: ignore[union-attr]
    after_delete = client.conversations.items.delete(added.data[0].id, conversation_id=created.id)
    assert after_delete.id == created.id and after_delete.object == "conversation"
    remaining = [item.content[0].text for item in client.conversations.items.list(created.id, order="asc")]  # type: ignore[union-attr]
    assert remaining == ["hello", "again", "fourth"]
    deleted = client.conversations.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "conversation.deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(created.id)


def test_items_page_by_cursor(client: openai.OpenAI) -> None:
    """The SDK's auto-pagination walks every page (`after` = the last id), in both orders."""
    conversation = client.conversations.create(items=[said(f"m{n}") for n in range(20)])  # type: ignore[misc]
    client.conversations.items.create(conversation.id, items=[said(f"m{n}") for n in range(20, 25)])  # type: ignore[misc]
    first = client.conversations.items.list(conversation.id, limit=7, order="asc")
    assert len(first.data) == 7 and first.has_more
    walked = [item.content[0].text for item in first]  # type: ignore[union-attr]
    assert walked == [f"m{n}" for n in range(25)]
    backwards = [item.content[0].text for item in client.conversations.items.list(conversation.id, limit=10)]  # type: ignore[union-attr]
    assert backwards == [f"m{n}" for n in reversed(range(25))]
    empty = client.conversations.create()
    page = client.conversations.items.list(empty.id)
    assert page.data == [] and not page.has_more


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda c: c.conversations.create(items=[said("x")] * 21), "items"),
        (
            lambda c: c.conversations.create(items=[{"type": "message", "role": "robot", "content": "x"}]),
            "items[0].role",
        ),
        (lambda c: c.conversations.create(metadata={f"k{n}": "v" for n in range(17)}), "metadata"),
        (lambda c: c.post("/conversations/conv_x", body={}, cast_to=dict), "metadata"),
        (lambda c: c.conversations.items.create("conv_x", items=[]), "items"),
    ],
    ids=["too-many-items", "bad-item", "too-much-metadata", "update-without-metadata", "no-items"],
)
def test_bad_bodies_are_400s_naming_what(
    client: openai.OpenAI, call: Callable[[openai.OpenAI], Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        call(client)
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_an_item_id_is_unique_within_a_conversation(client: openai.OpenAI) -> None:
    conversation = client.conversations.create(items=[{**said("x"), "id": "msg_mine"}])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError) as refused:
        client.conversations.items.create(conversation.id, items=[said("y"), {**said("z"), "id": "msg_mine"}])  # type: ignore[list-item]
    assert refused.value.body["param"] == "items[1].id"  # type: ignore[index]
    assert [item.id for item in client.conversations.items.list(conversation.id)] == ["msg_mine"]


def test_another_owners_conversation_is_a_404_on_every_route(
    client: openai.OpenAI, other_client: openai.OpenAI
) -> None:
    conversation = client.conversations.create(items=[said("mine")])  # type: ignore[list-item]
    item_id = client.conversations.items.list(conversation.id).data[0].id
    attempts: list[Callable[[], Any]] = [
        lambda: other_client.conversations.retrieve(conversation.id),
        lambda: other_client.conversations.update(conversation.id, metadata={"a": "b"}),
        lambda: other_client.conversations.items.list(conversation.id),
        lambda: other_client.conversations.items.create(conversation.id, items=[said("theirs")]),  # type: ignore[list-item]
        lambda: other_client.conversations.items.retrieve(item_id, conversation_id=conversation.id),
        lambda: other_client.conversations.items.delete(item_id, conversation_id=conversation.id),
        lambda: other_client.conversations.delete(conversation.id),
    ]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert [item.id for item in client.conversations.items.list(conversation.id)] == [item_id]
    assert client.conversations.retrieve(conversation.id).metadata == {}
