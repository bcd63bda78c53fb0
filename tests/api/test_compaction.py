"""Compaction (issue 18) with the SDK, on both kinds of upstream: `responses.compact`, then a turn
that carries its item; `compaction_trigger`; `context_management` past its threshold; and what
respool refuses (a forged, altered or another owner's item)."""

from __future__ import annotations

import base64
from typing import Any

import openai
import pytest
from openai.types.responses import CompactedResponse

from tests.conftest import NATIVE_MODEL
from tests.support.upstream_process import ScriptedUpstream
from worker.protocol.compaction import PREFIX, SUMMARY_HEADING, SUMMARY_PROMPT

pytestmark = pytest.mark.integration

HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "I like green tea."},
    {"role": "assistant", "content": "Noted: green tea."},
    {"role": "user", "content": "Find the magic number."},
    {"role": "assistant", "content": "The magic number is 42."},
]


def chat_texts(request: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, text) of each chat message the upstream was sent."""
    out = []
    for message in request["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = " ".join(part.get("text", "") for part in content)
        out.append((message["role"], content))
    return out


def input_texts(request: dict[str, Any]) -> list[tuple[str, str]]:
    """(role or type, text) of each input item a Responses upstream was sent."""
    out = []
    for item in request["input"]:
        content = item.get("content")
        if isinstance(content, list):
            content = " ".join(part.get("text", "") for part in content)
        out.append(
            (
                item.get("role") or item["type"],
                content if content is not None else item.get("encrypted_content"),
            )
        )
    return out


def as_input(compacted: CompactedResponse) -> list[dict[str, Any]]:
    # The SDK reads the user messages as output messages: dumped back, they are what was sent.
    return [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]


def test_compact_on_a_chat_upstream_then_a_turn_that_uses_it(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"times": 1, "text": "Likes green tea; the number is 42.", "then": {"text": "ok"}})
    compacted = client.responses.compact(model=model, input=HISTORY, instructions="Be brief.")  # type: ignore[arg-type]
    assert isinstance(compacted, CompactedResponse) and compacted.object == "response.compaction"
    *users, item = compacted.output
    assert [user.content[0].text for user in users] == ["I like green tea.", "Find the magic number."]  # type: ignore[union-attr]
    assert item.type == "compaction" and item.encrypted_content.startswith(PREFIX)
    sealed = base64.urlsafe_b64decode(item.encrypted_content.removeprefix(PREFIX))
    for said in ("green tea", "number is 42"):  # sealed, not readable: neither as text nor as bytes
        assert said not in item.encrypted_content and said.encode() not in sealed
    assert compacted.usage.output_tokens > 0
    (asked,) = upstream.requests(model)
    assert asked["max_tokens"] == 2048  # RESPOOL_COMPACT_SUMMARY_TOKENS
    assert chat_texts(asked)[0] == ("system", "Be brief.")
    assert chat_texts(asked)[-1] == ("user", SUMMARY_PROMPT)  # after the whole history
    assert ("assistant", "The magic number is 42.") in chat_texts(asked)

    answer = client.responses.create(
        model=model, input=[*as_input(compacted), {"role": "user", "content": "Go on."}]
    )  # type: ignore[list-item]
    assert (answer.status, answer.output_text) == ("completed", "ok")
    assert chat_texts(upstream.requests(model)[-1]) == [
        ("user", "I like green tea."),
        ("user", "Find the magic number."),
        ("user", SUMMARY_HEADING + "Likes green tea; the number is 42."),
        ("user", "Go on."),
    ]  # the model's turns are gone: the summary stands for them


def test_compact_follows_a_chain(client: openai.OpenAI, upstream: ScriptedUpstream, model: str) -> None:
    upstream.script(model, {"times": 1, "text": "The first answer.", "then": {"text": "A summary."}})
    first = client.responses.create(model=model, input="A first question.")
    compacted = client.responses.compact(model=model, previous_response_id=first.id, input="A second one.")
    assert [user.content[0].text for user in compacted.output[:-1]] == ["A first question.", "A second one."]  # type: ignore[union-attr]
    assert ("assistant", "The first answer.") in chat_texts(upstream.requests(model)[-1])


def test_what_respool_cannot_open_is_refused(
    client: openai.OpenAI, other_client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"text": "S."})
    item = as_input(client.responses.compact(model=model, input="remember this"))[-1]
    content = item["encrypted_content"]
    altered = content[:40] + ("A" if content[40] != "A" else "B") + content[41:]
    cases: list[tuple[openai.OpenAI, dict[str, Any]]] = [
        (client, {**item, "encrypted_content": altered}),
        (other_client, item),  # another owner's
        (
            client,
            {"type": "compaction", "encrypted_content": "gAAAAB-made-by-another-server"},
        ),  # a chat upstream cannot read it
    ]
    for who, given in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            who.responses.create(model=model, input=[{"role": "user", "content": "hi"}, given])  # type: ignore[list-item]
        assert refused.value.body["param"] == "input[1].encrypted_content"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as marked:  # what marks respool's own compact requests
        client.responses.create(model=model, input="hi", extra_body={"_respool_compact": True})
    assert marked.value.body["param"] == "_respool_compact"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as misplaced:
        client.responses.create(
            model=model, input=[{"type": "compaction_trigger"}, {"role": "user", "content": "hi"}]
        )  # type: ignore[list-item]
    assert misplaced.value.body["param"] == "input[0]"  # type: ignore[index]


def test_a_compaction_trigger_compacts_a_conversation(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A streamed response whose input ends with a trigger: its output is the one compaction item,
    told with `compacting` events; the conversation's next turn is sent the compacted window."""
    upstream.script(model, {"times": 2, "text": "The answer is forty two.", "then": {"text": "ok"}})
    conversation = client.conversations.create()
    client.responses.create(model=model, conversation=conversation.id, input="What is the answer?")
    with client.responses.stream(
        model=model,
        conversation=conversation.id,
        input=[{"type": "compaction_trigger"}],  # type: ignore[list-item]
    ) as stream:
        kinds = [event.type for event in stream]
        compacted = stream.get_final_response()
    assert kinds[kinds.index("response.output_item.added") + 1] == "response.compaction.compacting"
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    (item,) = compacted.output
    assert item.type == "compaction" and item.encrypted_content.startswith(PREFIX)
    summary_request = upstream.requests(model)[-1]
    assert chat_texts(summary_request)[-1] == ("user", SUMMARY_PROMPT)

    client.responses.create(model=model, conversation=conversation.id, input="And then?")
    assert chat_texts(upstream.requests(model)[-1]) == [
        ("user", "What is the answer?"),
        ("user", SUMMARY_HEADING + "The answer is forty two."),
        ("user", "And then?"),
    ]  # the conversation holds every item; what is before the window is left out
    kept = [entry.type for entry in client.conversations.items.list(conversation.id, order="asc")]
    assert kept == ["message", "message", "compaction_trigger", "compaction", "message", "message"]


def test_context_management_past_its_threshold_compacts_before_answering(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(
        model, {"times": 1, "text": "They talked about tea and 42.", "then": {"text": "the answer"}}
    )
    response = client.responses.create(
        model=model,
        input=[*HISTORY, {"role": "user", "content": "So?"}],  # type: ignore[list-item]
        context_management=[{"type": "compaction", "compact_threshold": 20}],
    )
    assert [item.type for item in response.output] == ["compaction", "message"]
    assert response.output_text == "the answer"
    sent = upstream.requests(model)
    assert [request["path"] for request in sent] == [
        "/tokenize",
        "/v1/chat/completions",
        "/v1/chat/completions",
    ]
    # The window keeps the latest user messages within half the threshold (10 tokens): "So?" alone.
    assert chat_texts(sent[-1]) == [
        ("user", "So?"),
        ("user", SUMMARY_HEADING + "They talked about tea and 42."),
    ]
    assert (
        response.usage is not None and response.usage.output_tokens == 6 + 2
    )  # the summary's and the answer's

    follow = client.responses.create(model=model, previous_response_id=response.id, input="More?")
    assert chat_texts(upstream.requests(model)[-1])[-3:] == [
        ("user", SUMMARY_HEADING + "They talked about tea and 42."),
        ("assistant", "the answer"),
        ("user", "More?"),
    ]
    assert follow.status == "completed"

    below = client.responses.create(
        model=model, input="short", context_management=[{"type": "compaction", "compact_threshold": 1000}]
    )
    assert [item.type for item in below.output] == ["message"]


def test_a_responses_upstream_compacts_itself_and_gets_its_own_item_back(
    client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.script(NATIVE_MODEL, {"text": "native answer"})
    compacted = client.responses.compact(model=NATIVE_MODEL, input=HISTORY)  # type: ignore[arg-type]
    item = compacted.output[-1]
    assert item.type == "compaction" and item.encrypted_content == "upstream-compaction:2"
    before = len(upstream.requests(NATIVE_MODEL))
    client.responses.create(
        model=NATIVE_MODEL, input=[*as_input(compacted), {"role": "user", "content": "Go on."}]
    )  # type: ignore[list-item]
    (sent,) = upstream.requests(NATIVE_MODEL)[before:]
    assert sent["path"] == "/v1/responses"
    assert {"type": "compaction", "encrypted_content": "upstream-compaction:2"}.items() <= sent["input"][
        2
    ].items()


def test_a_responses_upstream_without_compact_gets_respools(
    client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    """vLLM serves no `/responses/compact`: respool asks the model for the summary through `/responses`
    and expands its own item for the next turn; `context_management` is never forwarded."""
    upstream.script(
        NATIVE_MODEL, {"times": 2, "compact": False, "text": "Native summary.", "then": {"text": "done"}}
    )
    before = len(upstream.requests(NATIVE_MODEL))
    compacted = client.responses.compact(model=NATIVE_MODEL, input=HISTORY)  # type: ignore[arg-type]
    assert compacted.output[-1].encrypted_content.startswith(PREFIX)  # type: ignore[union-attr]
    response = client.responses.create(
        model=NATIVE_MODEL,
        input=[*as_input(compacted), {"role": "user", "content": "Go on."}],  # type: ignore[list-item]
        context_management=[{"type": "compaction", "compact_threshold": 100000}],
    )
    assert response.output_text == "done"
    sent = upstream.requests(NATIVE_MODEL)[before:]
    assert [request["path"] for request in sent] == [
        "/v1/responses/compact",
        "/v1/responses",
        "/v1/responses",
    ]
    assert input_texts(sent[1])[-1] == ("user", SUMMARY_PROMPT)
    assert input_texts(sent[2]) == [
        ("user", "I like green tea."),
        ("user", "Find the magic number."),
        ("user", SUMMARY_HEADING + "Native summary."),
        ("user", "Go on."),
    ]
    assert "context_management" not in sent[2]


def test_context_management_on_a_responses_upstream(
    client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.script(NATIVE_MODEL, {"times": 1, "text": "Short summary.", "then": {"text": "native answer"}})
    before = len(upstream.requests(NATIVE_MODEL))
    response = client.responses.create(
        model=NATIVE_MODEL,
        input=[*HISTORY, {"role": "user", "content": "So?"}],  # type: ignore[list-item]
        context_management=[{"type": "compaction", "compact_threshold": 10}],  # estimated: far past it
    )
    assert [item.type for item in response.output] == ["compaction", "message"]
    sent = upstream.requests(NATIVE_MODEL)[before:]
    assert input_texts(sent[-1])[-1] == ("user", SUMMARY_HEADING + "Short summary.")
    assert ("assistant", "The magic number is 42.") not in input_texts(sent[-1])


def test_a_compaction_trigger_on_a_responses_upstream(
    client: openai.OpenAI, upstream: ScriptedUpstream
) -> None:
    upstream.script(NATIVE_MODEL, {"times": 2, "text": "Native words.", "then": {"text": "after"}})
    first = client.responses.create(model=NATIVE_MODEL, input="Remember the word lantern.")
    compacted = client.responses.create(
        model=NATIVE_MODEL,
        previous_response_id=first.id,
        input=[{"type": "compaction_trigger"}],  # type: ignore[list-item]
    )
    assert [item.type for item in compacted.output] == ["compaction"]
    before = len(upstream.requests(NATIVE_MODEL))
    client.responses.create(model=NATIVE_MODEL, previous_response_id=compacted.id, input="Which word?")
    (sent,) = upstream.requests(NATIVE_MODEL)[before:]
    assert input_texts(sent) == [
        ("user", "Remember the word lantern."),
        ("user", SUMMARY_HEADING + "Native words."),
        ("user", "Which word?"),
    ]
