"""A native (Responses) upstream through real processes: its quirks never reach the client (DESIGN.md §6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import NATIVE_MODEL
from tests.support.schema import validate_event, validate_response
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parents[1] / "worker" / "translation" / "fixtures" / "native"


def _replay(upstream: ScriptedUpstream, fixture: str) -> list[dict[str, Any]]:
    """Script the native model's next request to send a recorded stream; its later ones echo."""
    events: list[dict[str, Any]] = json.loads((FIXTURES / f"{fixture}.json").read_text())["events"]
    upstream.script(NATIVE_MODEL, {"times": 1, "events": events, "delay": 0.01, "then": {}})
    return events


def _wire(events: list[Any]) -> list[dict[str, Any]]:
    return [event.model_dump(mode="json", exclude_unset=True) for event in events]


def test_vllm_quirks_become_a_clean_stream(client: openai.OpenAI, upstream: ScriptedUpstream) -> None:
    """vLLM's reused ids and per-token content indexes reach the client as a valid stream of respool's items."""
    recorded = _replay(upstream, "vllm_reasoning_then_text")
    wire = _wire(list(client.responses.create(model=NATIVE_MODEL, input="hi", stream=True)))
    for event in wire:
        validate_event(event)
    assert [event["sequence_number"] for event in wire] == list(range(len(wire)))
    final = wire[-1]["response"]
    validate_response(final)
    assert [(item["type"], item["id"][:3]) for item in final["output"]] == [
        ("reasoning", "rs_"),
        ("message", "msg"),
    ]
    upstream_ids = {event["item_id"] for event in recorded if "item_id" in event}
    assert not upstream_ids & {event["item_id"] for event in wire if "item_id" in event}
    assert {event["content_index"] for event in wire if "content_index" in event} == {0}
    done = [event["item"] for event in wire if event["type"] == "response.output_item.done"]
    assert final["output"] == done
    assert (
        client.responses.retrieve(final["id"]).model_dump(mode="json", exclude_unset=True)["output"] == done
    )


def test_harmony_tool_call_round_trip(client: openai.OpenAI, upstream: ScriptedUpstream) -> None:
    """A vLLM harmony tool call keeps the call_id first told, and its output goes back upstream under it."""
    _replay(upstream, "vllm_harmony_tool_call")
    with client.responses.stream(model=NATIVE_MODEL, input="weather?") as stream:
        first = stream.get_final_response()
    call = next(item for item in first.output if item.type == "function_call")
    assert (call.name, call.arguments, call.call_id) == (
        "get_weather",
        '{"city": "Paris"}',
        "call_2b3c4d5e6f7a4b8c",
    )
    second = client.responses.create(
        model=NATIVE_MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert second.status == "completed"
    sent = upstream.requests(NATIVE_MODEL)[-1]["input"]
    calls = [item for item in sent if item.get("type") in {"function_call", "function_call_output"}]
    assert [(item["type"], item["call_id"]) for item in calls] == [
        ("function_call", call.call_id),
        ("function_call_output", call.call_id),
    ]


def test_upstream_failing_mid_message(client: openai.OpenAI, upstream: ScriptedUpstream) -> None:
    """An upstream response.failed mid-message closes the message incomplete, then fails with the upstream's words."""
    _replay(upstream, "openai_failed_mid_message")
    wire = _wire(list(client.responses.create(model=NATIVE_MODEL, input="hi", stream=True)))
    types = [event["type"] for event in wire]
    assert types[-3:] == ["response.content_part.done", "response.output_item.done", "response.failed"]
    final = wire[-1]["response"]
    assert final["error"]["code"] == "server_error"
    assert "The model had an error" in final["error"]["message"]
    assert [(item["status"], item["content"][0]["text"]) for item in final["output"]] == [
        ("incomplete", "Hello")
    ]
    stored = client.responses.retrieve(final["id"])
    assert stored.status == "failed" and stored.output_text == "Hello"


def test_a_chain_that_moves_from_a_native_to_a_chat_model_checks_its_history(
    client: openai.OpenAI, model: str
) -> None:
    """A native response whose input held what only a Responses upstream takes (a file by URL) can go
    on natively, but not on a Chat Completions model, which cannot be sent it: a 400 at create, not a
    failure later."""
    by_url = {"type": "input_file", "file_url": "https://example.com/report.pdf"}
    question = [{"role": "user", "content": [{"type": "input_text", "text": "summarise"}, by_url]}]
    first = client.responses.create(model=NATIVE_MODEL, input=question)  # type: ignore[arg-type]
    assert first.status == "completed"
    with pytest.raises(openai.BadRequestError, match="file_data"):
        client.responses.create(model=model, previous_response_id=first.id, input="and then?")
    following = client.responses.create(model=NATIVE_MODEL, previous_response_id=first.id, input="and then?")
    assert following.status == "completed"
