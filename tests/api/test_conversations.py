"""The Conversations API (issue 18) through real processes, with the `openai` SDK as the client:
the lifecycle, cursor pagination, limits and errors, and owner isolation on every route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.support.faults import wait_until_ended
from tests.support.tool_servers import McpServerProcess
from tests.support.upstream_process import ScriptedUpstream

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


def _texts(client: openai.OpenAI, conversation_id: str) -> list[str]:
    items = client.conversations.items.list(conversation_id, order="asc", limit=100)
    return [part.text for item in items for part in item.content]  # type: ignore[union-attr]


def test_responses_on_a_conversation_see_its_items_and_add_theirs(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Three turns on one conversation (plain, streamed, background): each upstream request carries
    every earlier item, each Response names the conversation, and each turn's input and output are
    appended once, in order."""
    conversation = client.conversations.create(items=[said("My name is Ada.")])  # type: ignore[list-item]
    first = client.responses.create(model=model, input="one", conversation=conversation.id)
    assert first.conversation is not None and first.conversation.id == conversation.id
    with client.responses.create(
        model=model, input="two", conversation={"id": conversation.id}, stream=True
    ) as events:
        second = [event for event in events][-1].response  # type: ignore[union-attr]
    third = client.responses.create(model=model, input="three", conversation=conversation.id, background=True)
    wait_until_ended(client, [third.id], timeout=30)
    assert client.responses.retrieve(third.id).conversation.id == conversation.id  # type: ignore[union-attr]
    answer = "Hello from the scripted upstream. You said: "
    assert _texts(client, conversation.id) == [
        "My name is Ada.", "one", answer + "one", "two", answer + "two", "three", answer + "three",
    ]  # fmt: skip
    sent = [[message["content"] for message in request["messages"]] for request in upstream.requests(model)]
    assert sent == [
        ["My name is Ada.", "one"],
        ["My name is Ada.", "one", answer + "one", "two"],
        ["My name is Ada.", "one", answer + "one", "two", answer + "two", "three"],
    ]
    assert second.output_text == answer + "two"


def test_a_failed_response_leaves_its_conversation_as_it_was(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    conversation = client.conversations.create(items=[said("before")])  # type: ignore[list-item]
    upstream.script(model, {"status": 400, "error": {"message": "no"}})
    failed = client.responses.create(model=model, input="lost?", conversation=conversation.id)
    assert failed.status == "failed"
    assert _texts(client, conversation.id) == ["before"]


def test_conversation_errors(client: openai.OpenAI, other_client: openai.OpenAI, model: str) -> None:
    """With `previous_response_id` a 400; an unknown conversation, or another owner's, a 404 naming it."""
    conversation = client.conversations.create()
    earlier = client.responses.create(model=model, input="x")
    with pytest.raises(openai.BadRequestError) as both:
        client.responses.create(
            model=model, input="y", conversation=conversation.id, previous_response_id=earlier.id
        )
    assert both.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for sdk, conversation_id in [(client, "conv_nothere"), (other_client, conversation.id)]:
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.responses.create(model=model, input="y", conversation=conversation_id)
        assert missing.value.body["param"] == "conversation"  # type: ignore[index]
    assert client.conversations.items.list(conversation.id).data == []


def test_two_responses_at_once_see_what_was_there_and_land_in_finishing_order(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A slow response and then a quick one on one conversation: each is sent only the items present
    when it was created; the quick one's items land first, the slow one's after."""
    slow, quick = f"{model}-slow", f"{model}-quick"
    upstream.script(slow, {"text": "slow answer", "delay": 0.5})
    upstream.script(quick, {"text": "quick answer"})
    conversation = client.conversations.create(items=[said("start")])  # type: ignore[list-item]
    first = client.responses.create(model=slow, input="slow?", conversation=conversation.id, background=True)
    upstream.stats(until_active=1, timeout=30)  # the slow one is running
    second = client.responses.create(
        model=quick, input="quick?", conversation=conversation.id, background=True
    )
    wait_until_ended(client, [first.id, second.id], timeout=60)
    assert _texts(client, conversation.id) == ["start", "quick?", "quick answer", "slow?", "slow answer"]
    for name, asked in [(slow, "slow?"), (quick, "quick?")]:
        (request,) = upstream.requests(name)
        assert [message["content"] for message in request["messages"]] == ["start", asked]


def test_the_tool_loops_items_join_the_conversation(
    client: openai.OpenAI, upstream: ScriptedUpstream, mcp_server: McpServerProcess, model: str
) -> None:
    """A turn that ran an MCP tool appends its listing, its call and the answer; the next turn is
    given the call and its result, and reuses the listing (the server is not listed again)."""
    tool = {"type": "mcp", "server_label": "tools", "server_url": mcp_server.url, "require_approval": "never"}
    upstream.script(model, {"tool_loop": {"tool": "lookup"}})
    conversation = client.conversations.create()
    client.responses.create(model=model, input="weather?", conversation=conversation.id, tools=[tool])  # type: ignore[list-item]
    kinds = [item.type for item in client.conversations.items.list(conversation.id, order="asc")]
    assert kinds == ["message", "mcp_list_tools", "mcp_call", "message"]
    upstream.script(model, {"tool_loop": {"tool": "lookup", "steps": 2}})  # one more call, then answer
    again = client.responses.create(model=model, input="and now?", conversation=conversation.id, tools=[tool])  # type: ignore[list-item]
    assert [item.type for item in again.output] == ["mcp_call", "message"]  # no second listing
    history = upstream.requests(model)[2]["messages"]
    assert history[2]["role"] == "tool" and history[2]["content"] == "Sunny in Paris, 21C."


def test_store_false_on_a_conversation_keeps_the_turn_in_the_conversation_only(
    client: openai.OpenAI, model: str
) -> None:
    """`store: false` keeps no Response to retrieve, but the turn still joins the conversation (its
    items are the conversation's, which has no expiry: OpenAI's conversation-state guide)."""
    conversation = client.conversations.create()
    unstored = client.responses.create(
        model=model, input="off the record", conversation=conversation.id, store=False
    )
    assert unstored.status == "completed" and unstored.conversation.id == conversation.id  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    assert _texts(client, conversation.id) == [
        "off the record",
        "Hello from the scripted upstream. You said: off the record",
    ]


def test_a_cancelled_response_leaves_its_conversation_as_it_was(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A background response on a conversation, cancelled mid-output: the conversation keeps only what
    it had (a cancelled turn did not happen, like a failed one)."""
    upstream.script(model, {"text": " ".join(f"w{n}" for n in range(100)), "delay": 0.2})
    conversation = client.conversations.create(items=[said("before")])  # type: ignore[list-item]
    running = client.responses.create(
        model=model, input="stop me", conversation=conversation.id, background=True
    )
    upstream.stats(until_active=1, timeout=30)
    assert client.responses.cancel(running.id).status == "cancelled"
    wait_until_ended(client, [running.id], timeout=30)
    assert _texts(client, conversation.id) == ["before"]
