"""Each kind of upstream stream, through real processes: what the client receives, valid and consistent."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support.schema import validate_event, validate_response
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration


def _call(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


KINDS: dict[str, tuple[dict[str, Any], str, str | None]] = {
    "refusal": (
        {
            "chunks": [
                {"delta": {"refusal": "I can't "}},
                {"delta": {"refusal": "help."}},
                {"finish_reason": "stop", "delta": {}},
            ]
        },
        "completed",
        None,
    ),
    "parallel tool calls": (
        {
            "chunks": [
                {"delta": {"tool_calls": [_call(0, "call_a", "f", '{"x"')]}},
                {"delta": {"tool_calls": [_call(1, "call_b", "g", '{"y"')]}},
                {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}},
                {"delta": {"tool_calls": [{"index": 1, "function": {"arguments": ": 2}"}}]}},
                {"delta": {}, "finish_reason": "tool_calls"},
            ]
        },
        "completed",
        None,
    ),
    "reasoning then text": (
        {
            "chunks": [
                {"delta": {"reasoning_content": "Think "}},
                {"delta": {"reasoning_content": "first."}},
                {"delta": {"content": "Answer."}},
                {"delta": {}, "finish_reason": "stop"},
            ]
        },
        "completed",
        None,
    ),
    "length": ({"text": "cut short here", "finish_reason": "length"}, "incomplete", "max_output_tokens"),
    "content filter": ({"text": "cut", "finish_reason": "content_filter"}, "incomplete", "content_filter"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_stream_kind(client: openai.OpenAI, upstream: ScriptedUpstream, model: str, kind: str) -> None:
    """The stream is schema-valid, gapless, ends in the right status, and its final output equals the stored one."""
    script, status, reason = KINDS[kind]
    upstream.script(model, script)
    events = list(client.responses.create(model=model, input="x", stream=True))
    wire = [event.model_dump(mode="json", exclude_unset=True) for event in events]
    for event in wire:
        validate_event(event)
    assert [event["sequence_number"] for event in wire] == list(range(len(wire)))
    final = wire[-1]["response"]
    validate_response(final)
    assert final["status"] == status
    assert (final["incomplete_details"] or {}).get("reason") == reason
    done_items = [event["item"] for event in wire if event["type"] == "response.output_item.done"]
    assert final["output"] == done_items
    stored = client.responses.retrieve(final["id"]).model_dump(mode="json", exclude_unset=True)
    assert stored["output"] == final["output"]


def test_parallel_tool_calls_arrive_whole(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Two interleaved tool calls come out as two function_call items with their full arguments."""
    upstream.script(model, KINDS["parallel tool calls"][0])
    response = client.responses.create(model=model, input="x", tools=[_tool("f"), _tool("g")])
    calls = [
        (item.call_id, item.name, item.arguments) for item in response.output if item.type == "function_call"
    ]
    assert calls == [("call_a", "f", '{"x": 1}'), ("call_b", "g", '{"y": 2}')]


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": {"type": "object"}, "strict": False}


def test_upstream_dropping_mid_stream_fails_the_response(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """An upstream that cuts the connection mid-stream ends the response with response.failed and a message."""
    upstream.script(model, {"text": "one two three four five", "drop_after": 3})
    events = list(client.responses.create(model=model, input="x", stream=True))
    assert events[-1].type == "response.failed"
    error = events[-1].response.error
    assert error is not None and error.code == "server_error" and "upstream" in error.message
    assert client.responses.retrieve(events[0].response.id).status == "failed"
