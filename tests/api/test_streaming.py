"""Streams, live and replayed from any offset, through any API process (PROTOCOL.md §4-§6)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.support.schema import validate_event, validate_response
from tests.support.stack import Stack
from tests.support.upstream_process import ScriptedUpstream
from tests.support.validating import ValidatingTransport

pytestmark = pytest.mark.integration


def _wire(events: list[object]) -> list[dict[str, object]]:
    return [event.model_dump(mode="json", exclude_unset=True) for event in events]  # type: ignore[attr-defined]


def test_background_stream_is_valid_and_ordered(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A background stream opens created, queued, in_progress; numbers every event; and every event is valid."""
    upstream.script(model, {"text": "alpha beta gamma", "delay": 0.05})
    events = list(client.responses.create(model=model, input="x", background=True, stream=True))
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    for event in _wire(events):
        validate_event(event)
    validate_response(_wire(events)[-1]["response"])  # type: ignore[arg-type]


@pytest.mark.parametrize("offset", [0, 3, 7])
def test_replay_from_an_offset_is_the_tail_of_the_live_stream(
    client: openai.OpenAI, second_api: openai.OpenAI, upstream: ScriptedUpstream, model: str, offset: int
) -> None:
    """`starting_after=N`, on either API process, gives exactly the live stream's events after N."""
    upstream.script(model, {"text": "one two three four five six seven eight", "delay": 0.02})
    live = _wire(list(client.responses.create(model=model, input="x", background=True, stream=True)))
    response_id = live[0]["response"]["id"]  # type: ignore[index]
    for sdk in (client, second_api):
        replay = _wire(list(sdk.responses.retrieve(response_id, stream=True, starting_after=offset)))
        assert replay == live[offset + 1 :]


def test_resume_mid_stream_on_another_api_process(
    client: openai.OpenAI, second_api: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A client that drops a live stream resumes it on another API process from its last sequence number."""
    upstream.script(model, {"text": " ".join(f"w{n}" for n in range(30)), "delay": 0.05})
    stream = client.responses.create(model=model, input="x", background=True, stream=True)
    seen = []
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) > 8:
            break
    stream.close()
    response_id = seen[0].response.id  # type: ignore[union-attr]
    rest = list(
        second_api.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number)
    )
    events = seen + rest
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == " ".join(f"w{n}" for n in range(30))
    assert events[-1].type == "response.completed"


def test_sdk_stream_helpers(client: openai.OpenAI, second_api: openai.OpenAI, model: str) -> None:
    """`responses.stream(...)` gives the final response, and its resume form replays from the start and filters."""
    with client.responses.stream(model=model, input="helper", background=True) as stream:
        final = stream.get_final_response()
    assert final.output_text.endswith("You said: helper")
    with second_api.responses.stream(response_id=final.id, starting_after=2) as resumed:
        numbers = [event.sequence_number for event in resumed]
    assert numbers[0] == 3
    assert resumed.get_final_response().output_text == final.output_text


class Answer(BaseModel):
    said: str


def test_parse_with_a_pydantic_format(client: openai.OpenAI, upstream: ScriptedUpstream, model: str) -> None:
    """`responses.parse` with `text_format` sends a json_schema format upstream and parses the JSON reply."""
    upstream.script(model, {"text": '{"said": "hi"}'})
    parsed = client.responses.parse(model=model, input="x", text_format=Answer)
    assert parsed.output_parsed == Answer(said="hi")
    sent = upstream.requests(model)[-1]
    assert sent["response_format"]["type"] == "json_schema"


def test_a_queued_response_streams_heartbeats_until_it_ends(
    queue_only: Stack, open_client: openai.OpenAI
) -> None:
    """Streaming a response still queued sends its first events, comment heartbeats while silent, and its end."""
    created = open_client.responses.create(model="synthetic", input="x", background=True)
    url = f"{queue_only.url}/v1/responses/{created.id}?stream=true"
    frames: list[str] = []
    with httpx.Client(transport=ValidatingTransport(), timeout=30) as http, http.stream("GET", url) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            frames.append(line)
            if line == ": keepalive" and frames.count(": keepalive") == 2:
                open_client.responses.cancel(created.id)
    data = [line for line in frames if line.startswith("data: ")]
    assert [json.loads(line[6:])["type"] for line in data] == [
        "response.created",
        "response.queued",
        "response.failed",
    ]
    assert not any(line.startswith("id:") for line in frames)  # PROTOCOL.md §5.3


def test_starting_after_the_end_of_a_finished_response_is_an_empty_stream(
    client: openai.OpenAI, model: str
) -> None:
    """A finished response asked for events after its last one answers an empty stream at once (PROTOCOL.md §6.3)."""
    events = list(client.responses.create(model=model, input="x", stream=True))
    response_id, last = events[0].response.id, events[-1].sequence_number  # type: ignore[union-attr]
    for after in (last, last + 5):
        assert list(client.responses.retrieve(response_id, stream=True, starting_after=after)) == []
