"""Responses events from a native upstream => respool's events, on streams in the shapes real servers send."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.support.schema import validate_event, validate_response
from tests.worker.translation.test_chat_stream import RESPONSE
from worker.errors import UpstreamStreamError
from worker.translation.chat_stream import Outcome
from worker.translation.native import (
    NativeStream,
    finish_stream,
    to_responses_request,
    translate_event,
)
from worker.translation.output import close_open, output_items

FIXTURES = Path(__file__).parent / "fixtures" / "native"
EVENT = TypeAdapter(ResponseStreamEvent)
Events = list[dict[str, Any]]

# fixture => (status, output items as (type, status, text), usage (input, cached, output, reasoning))
CASES: dict[str, tuple[str, list[tuple[str, str, str]], tuple[int, int, int, int]]] = {
    "openai_text": ("completed", [("message", "completed", "Hello there!")], (9, 0, 3, 0)),
    "openai_reasoning_tool_call": (
        "completed",
        [
            (
                "reasoning",
                "completed",
                "**Checking weather**\n\nI need the weather tool.|Calling it for Paris.",
            ),
            ("function_call", "completed", 'get_weather{"city":"Paris"}'),
        ],
        (60, 32, 90, 64),
    ),
    "vllm_reasoning_then_text": (
        "completed",
        [("reasoning", "completed", "The user says hi."), ("message", "completed", "Hello! How can I help?")],
        (11, 0, 9, 0),
    ),
    "vllm_harmony_tool_call": (
        "completed",
        [
            ("reasoning", "completed", "Need weather. Call tool."),
            ("function_call", "completed", 'get_weather{"city": "Paris"}'),
        ],
        (11, 0, 9, 0),
    ),
    "openai_incomplete": ("incomplete", [("message", "completed", "Once upon a")], (9, 0, 3, 0)),
    "openai_web_search": (
        "completed",
        [("web_search_call", "completed", ""), ("message", "completed", "Sunny, 21C.")],
        (9, 0, 3, 0),
    ),
}
NAMES = list(CASES)


def load(name: str) -> Events:
    events: Events = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["events"]
    return events


def run(upstream_events: Events) -> tuple[Events, Outcome]:
    state = NativeStream()
    events = [event for upstream in upstream_events for event in translate_event(state, upstream)]
    closing, outcome = finish_stream(state)
    return events + closing, outcome


def texts(output: Events) -> list[tuple[str, str, str]]:
    """Each item as (type, status, its text parts or summaries joined by |, or its name and arguments)."""
    summary = []
    for entry in output:
        if entry["type"] == "function_call":
            text = entry["name"] + entry["arguments"]
        elif entry["type"] in {"message", "reasoning"}:
            parts = entry["content"] or entry.get("summary") or []
            text = "|".join(part.get("text", part.get("refusal", "")) for part in parts)
        else:
            text = ""
        summary.append((entry["type"], entry["status"], text))
    return summary


def numbered(events: Events, outcome: Outcome | None = None) -> Events:
    """The whole stream as a client gets it: lifecycle events around respool's, numbered from 0."""
    response = {**RESPONSE, "status": "in_progress", "output": [], "usage": None, "completed_at": None}
    response["incomplete_details"] = None
    whole = [{"type": "response.created", "response": response}, *copy.deepcopy(events)]
    if outcome is not None:
        final = {**response, "status": outcome.status, "output": outcome.output, "usage": outcome.usage}
        final["incomplete_details"] = outcome.incomplete_details
        final["completed_at"] = 2 if outcome.status == "completed" else None
        whole.append({"type": f"response.{outcome.status}", "response": final})
    return [{**event, "sequence_number": number} for number, event in enumerate(whole)]


@pytest.mark.parametrize(("fixture", "expected"), CASES.items(), ids=NAMES)
def test_outcome(fixture: str, expected: tuple[str, list[tuple[str, str, str]], tuple[int, ...]]) -> None:
    """A recorded upstream stream ends in the expected status, items and usage."""
    _, outcome = run(load(fixture))
    usage = outcome.usage or {}
    counts = (
        usage["input_tokens"],
        usage["input_tokens_details"]["cached_tokens"],
        usage["output_tokens"],
        usage["output_tokens_details"]["reasoning_tokens"],
    )
    assert (outcome.status, texts(outcome.output), counts) == expected


@pytest.mark.parametrize("fixture", NAMES)
def test_every_event_is_valid(fixture: str) -> None:
    """Every event respool tells is valid for the Open Responses schema and the SDK's types, and so is the Response."""
    events, outcome = run(load(fixture))
    whole = numbered(events, outcome)
    for event in whole:
        assert EVENT.validate_python(event).type == event["type"]
        if not _is_hosted(event):
            validate_event(event)
    if not any(map(_is_hosted, whole)):
        validate_response(whole[-1]["response"])


def _is_hosted(event: dict[str, Any]) -> bool:
    """Whether an event is about a hosted tool item: the Open Responses schema has none (its
    ItemField is message, function_call, function_call_output, reasoning, compaction), so those
    are checked against the SDK's types alone."""
    items = [event.get("item"), *(event.get("response") or {}).get("output", [])]
    is_hosted_item = any(
        item and item["type"] not in {"message", "reasoning", "function_call"} for item in items
    )
    return is_hosted_item or str(event["type"]).startswith("response.web_search_call.")


@pytest.mark.parametrize("fixture", NAMES)
def test_the_sdk_stream_helper_accepts_the_stream(fixture: str) -> None:
    """The SDK's `responses.stream` accumulator takes the stream without error and rebuilds the same items and text."""
    events, outcome = run(load(fixture))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in numbered(events, outcome):
        state.handle_event(EVENT.validate_python(event))  # type: ignore[arg-type]
    snapshot = state._ResponseStreamState__current_snapshot  # type: ignore[attr-defined]
    assert [(item.type, item.id) for item in snapshot.output] == [
        (item["type"], item["id"]) for item in outcome.output
    ]
    assert [[part.text for part in item.content] for item in snapshot.output if item.type == "message"] == [
        [part["text"] for part in item["content"]] for item in outcome.output if item["type"] == "message"
    ]


@pytest.mark.parametrize("fixture", NAMES)
def test_ids_and_indexes_are_respools(fixture: str) -> None:
    """Items get respool's ids and output indexes 0..n in order; content indexes count parts, not tokens."""
    upstream = load(fixture)
    upstream_ids = {str(event.get("item_id")) for event in upstream} | {
        str((event.get("item") or {}).get("id")) for event in upstream
    }
    events, outcome = run(upstream)
    assert [item["id"] for item in outcome.output if item["id"] in upstream_ids] == []
    added = [event["output_index"] for event in events if event["type"] == "response.output_item.added"]
    assert added == list(range(len(outcome.output)))
    for event in events:
        if "content_index" in event:
            item = outcome.output[event["output_index"]]
            assert event["content_index"] < len(item["content"])
            assert event["item_id"] == item["id"]


@pytest.mark.parametrize("fixture", NAMES)
def test_done_events_carry_the_final_items(fixture: str) -> None:
    """Each item's `output_item.done` carries exactly what the final output holds for it."""
    events, outcome = run(load(fixture))
    done = {
        event["output_index"]: event["item"]
        for event in events
        if event["type"] == "response.output_item.done"
    }
    assert [done[index] for index in sorted(done)] == outcome.output


def test_call_ids_stay_as_first_told() -> None:
    """vLLM's harmony tool call changes its call_id at `.done`; the client keeps the one it was first told."""
    events, outcome = run(load("vllm_harmony_tool_call"))
    added = next(
        e["item"]
        for e in events
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    )
    assert added["call_id"] == outcome.output[1]["call_id"] == "call_2b3c4d5e6f7a4b8c"


def test_reasoning_keeps_the_encrypted_content() -> None:
    """encrypted_content, told only at the upstream's `output_item.done`, reaches the final item."""
    _, outcome = run(load("openai_reasoning_tool_call"))
    assert outcome.output[0]["encrypted_content"] == "gAAAAABo-opaque=="


def test_hosted_tool_events_are_relayed_readdressed() -> None:
    """A hosted tool's progress events reach the client under respool's item id."""
    events, outcome = run(load("openai_web_search"))
    progress = [event for event in events if event["type"].startswith("response.web_search_call.")]
    assert [event["type"].rsplit(".", 1)[1] for event in progress] == [
        "in_progress",
        "searching",
        "completed",
    ]
    assert {event["item_id"] for event in progress} == {outcome.output[0]["id"]}
    assert outcome.output[0]["action"] == {"type": "search", "query": "weather Paris"}


def test_annotations_are_told_and_kept() -> None:
    """A citation the upstream adds is an `annotation.added` event and stays on the final text part."""
    events, outcome = run(load("openai_web_search"))
    annotation = next(event for event in events if event["type"] == "response.output_text.annotation.added")
    assert outcome.output[1]["content"][0]["annotations"] == [annotation["annotation"]]


def test_obfuscation_padding_is_not_relayed() -> None:
    """The upstream's obfuscation padding is its own; respool's deltas do not carry it."""
    events, _ = run(load("openai_text"))
    assert not any("obfuscation" in event for event in events)


def test_whole_text_at_done_without_deltas_is_told() -> None:
    """An upstream that sends a text only in its `.done` event still gets it to the client as a delta."""
    whole = {"type": "message", "id": "m1", "role": "assistant", "status": "completed"}
    whole["content"] = [{"type": "output_text", "text": "All at once.", "annotations": []}]
    upstream = [
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**whole, "content": [], "status": "in_progress"},
        },
        {"type": "response.output_item.done", "output_index": 0, "item": whole},
        {"type": "response.completed", "response": {"status": "completed", "usage": None}},
    ]
    events, outcome = run(upstream)
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["All at once."]
    assert texts(outcome.output) == [("message", "completed", "All at once.")]


def test_a_failed_upstream_raises_with_its_message_and_open_items_can_be_closed() -> None:
    """`response.failed` mid-message raises UpstreamStreamError; what was streamed closes as incomplete."""
    state = NativeStream()
    *streamed, failure = load("openai_failed_mid_message")
    for upstream in streamed:
        translate_event(state, upstream)
    with pytest.raises(UpstreamStreamError, match="The model had an error"):
        translate_event(state, failure)
    closing = close_open(state.output, "incomplete")
    assert [event["type"] for event in closing][-1] == "response.output_item.done"
    assert texts(output_items(state.output)) == [("message", "incomplete", "Hello")]


@pytest.mark.parametrize(
    "upstream",
    [
        [{"type": "response.in_progress"}],
        [{"type": "error", "message": "overloaded", "code": "server_error"}],
    ],
    ids=["no terminal event", "error event"],
)
def test_a_stream_without_an_outcome_fails(upstream: Events) -> None:
    """A stream that ends without completing, or reports an error, is a UpstreamStreamError, never a completed response."""
    with pytest.raises(UpstreamStreamError):
        run(upstream)


def test_arguments_outside_any_call_fail_loudly() -> None:
    """Function call arguments for no call are an upstream fault, not silently dropped."""
    with pytest.raises(UpstreamStreamError, match="outside of any call"):
        run([{"type": "response.function_call_arguments.delta", "item_id": "x", "delta": "{}"}])


def test_request_is_stateless_upstream() -> None:
    """The upstream is sent store=false, stream=true and the whole conversation without respool's ids."""
    request = {
        "model": "m",
        "input": "hi",
        "store": True,
        "background": True,
        "metadata": {"a": "b"},
        "temperature": 0.2,
    }
    conversation = [
        {
            "id": "msg_1",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_text", "text": "hi"}],
        },
        {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": "e"},
    ]
    body = to_responses_request(request, conversation, "upstream-m")
    assert body == {
        "model": "upstream-m",
        "temperature": 0.2,
        "store": False,
        "stream": True,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": "e"},
        ],
    }
