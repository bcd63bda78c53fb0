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
    """An upstream cut mid-stream closes the open message incomplete, then ends response.failed with a message.

    The failed Response carries what was streamed, so it is exactly what the events add up to.
    """
    upstream.script(model, {"text": "one two three four five", "drop_after": 3})
    events = list(client.responses.create(model=model, input="x", stream=True))
    assert [event.type for event in events[-3:]] == [
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    final = events[-1].response  # type: ignore[union-attr]
    assert (
        final.error is not None and final.error.code == "server_error" and "upstream" in final.error.message
    )
    assert [(item.status, item.content[0].text) for item in final.output] == [("incomplete", "one two ")]  # type: ignore[union-attr]
    assert final.output == [events[-2].item]  # type: ignore[union-attr]
    stored = client.responses.retrieve(final.id)
    assert stored.status == "failed" and stored.output == final.output


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


# Chat Completions logprobs of two tokens, each with its two most likely candidates.
TOKENS = [
    {**_token("Hi", -0.1), "top_logprobs": [_token("Hi", -0.1), _token("Hey", -2.3)]},
    {**_token(" there", -0.5), "top_logprobs": [_token(" there", -0.5), _token(" you", -1.7)]},
]
LOGPROBS_SCRIPT = {
    "chunks": [
        {"delta": {"role": "assistant", "content": "Hi"}, "logprobs": {"content": [TOKENS[0]]}},
        {"delta": {"content": " there"}, "logprobs": {"content": [TOKENS[1]]}},
        {"delta": {}, "finish_reason": "stop"},
    ]
}


def _logprobs(logprobs: Any) -> list[dict[str, Any]]:
    return [logprob.model_dump(mode="json", exclude_unset=True) for logprob in logprobs or []]


def test_logprobs_stream_with_their_top_candidates(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """With logprobs included, each text delta, the text's done event and the stored part carry them."""
    upstream.script(model, LOGPROBS_SCRIPT)
    events = list(
        client.responses.create(
            model=model, input="x", stream=True, include=["message.output_text.logprobs"], top_logprobs=2
        )
    )
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    # Deltas that waited together for one append are merged (worker/translation/coalesce.py).
    assert [logprob for event in deltas for logprob in _logprobs(event.logprobs)] == TOKENS
    assert "".join(event.delta for event in deltas) == "Hi there"
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    assert (done.text, _logprobs(done.logprobs)) == ("Hi there", TOKENS)
    final = events[-1].response  # type: ignore[union-attr]
    stored = client.responses.retrieve(final.id)
    for response in (final, stored):
        part = response.output[0].content[0]  # type: ignore[union-attr]
        assert part.type == "output_text" and _logprobs(part.logprobs) == TOKENS
    sent = upstream.requests(model)[-1]
    assert (sent["logprobs"], sent["top_logprobs"]) == (True, 2)


USAGE_SCRIPT = {
    "chunks": [
        {"delta": {"role": "assistant", "content": "Done."}},
        {"delta": {}, "finish_reason": "stop"},
        {
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 7,
                "total_tokens": 17,
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 3},
            }
        },
    ]
}


def test_usage_keeps_cached_and_reasoning_tokens(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """The upstream's cached and reasoning token counts reach the terminal event's usage and the stored one."""
    upstream.script(model, USAGE_SCRIPT)
    events = list(client.responses.create(model=model, input="x", stream=True))
    assert events[-1].type == "response.completed"
    final = events[-1].response
    for usage in (final.usage, client.responses.retrieve(final.id).usage):
        assert usage is not None
        counts = (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens)
        assert (*counts, usage.output_tokens_details.reasoning_tokens, usage.total_tokens) == (
            10,
            4,
            7,
            3,
            17,
        )
