"""The Responses API through real processes, driven by the official SDK (PROTOCOL.md §5, §7, §10)."""

from __future__ import annotations

import openai
import pytest
from openai.types.responses import Response

from tests.conftest import NATIVE_MODEL
from tests.support.stack import wait_for
from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration

ECHO = "Hello from the scripted upstream. You said: "


def until_status(client: openai.OpenAI, response_id: str, *statuses: str, timeout: float = 30) -> Response:
    def check() -> Response | None:
        response = client.responses.retrieve(response_id)
        return response if response.status in statuses else None

    return wait_for(check, timeout=timeout, what=f"{response_id} to be {statuses}")


def test_background_polls_through_in_progress_to_completed(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """A background response is queued at once, is seen in_progress while the upstream streams, then completes."""
    upstream.script(model, {"text": "one two three four five six", "delay": 0.3})
    created = client.responses.create(model=model, input="hi", background=True)
    assert (created.status, created.background, created.output, created.usage) == ("queued", True, [], None)
    assert until_status(client, created.id, "in_progress").status == "in_progress"
    done = until_status(client, created.id, "completed")
    assert done.output_text == "one two three four five six"
    assert done.usage is not None and done.usage.output_tokens > 0
    assert done.completed_at is not None


def test_foreground_create_returns_the_finished_response(client: openai.OpenAI, model: str) -> None:
    """Without background, create holds the call and returns the completed Response, which is stored."""
    response = client.responses.create(model=model, input="foreground", metadata={"k": "v"}, temperature=0.5)
    assert response.status == "completed"
    assert response.output_text == ECHO + "foreground"
    assert (response.metadata, response.temperature) == ({"k": "v"}, 0.5)
    assert client.responses.retrieve(response.id).output_text == ECHO + "foreground"


def test_every_event_goes_through_the_stream_even_without_streaming(
    client: openai.OpenAI, model: str
) -> None:
    """A non-streaming response's events are all in its stream: replay gives created … completed in order."""
    response = client.responses.create(model=model, input="events")
    events = list(client.responses.retrieve(response.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "response.output_text.delta" in {event.type for event in events}


def test_stream_create_streams_the_events(client: openai.OpenAI, model: str) -> None:
    """`stream=True` relays SSE from response.created to response.completed."""
    events = list(client.responses.create(model=model, input="streamed", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == ECHO + "streamed"


def test_store_false_is_gone_once_finished(client: openai.OpenAI, model: str) -> None:
    """A store=false response is returned, then answers 404 on retrieve."""
    response = client.responses.create(model=model, input="ephemeral", store=False)
    assert response.status == "completed" and response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_background_with_store_false_is_rejected(client: openai.OpenAI, model: str) -> None:
    """background=true with store=false is a 400 naming `background` (PROTOCOL.md §7)."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="x", background=True, store=False)
    assert caught.value.param == "background"


def test_cancel_a_running_response(client: openai.OpenAI, upstream: ScriptedUpstream, model: str) -> None:
    """Cancelling an in-progress response returns it cancelled, closes the upstream call and ends the stream."""
    upstream.script(model, {"text": " ".join(["word"] * 200), "delay": 0.1})
    created = client.responses.create(model=model, input="long", background=True)
    until_status(client, created.id, "in_progress")
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert upstream.stats(until_active=0)["active"] == 0
    events = list(client.responses.retrieve(created.id, stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.status == "cancelled"
    assert client.responses.retrieve(created.id).status == "cancelled"
    assert client.responses.cancel(created.id).status == "cancelled"  # idempotent (PROTOCOL.md §7)


def test_cancel_rejects_finished_and_synchronous_responses(client: openai.OpenAI, model: str) -> None:
    """Cancelling a completed background response, or any foreground one, is a 400 on `response_id`."""
    background = client.responses.create(model=model, input="x", background=True)
    until_status(client, background.id, "completed")
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a completed response") as caught:
        client.responses.cancel(background.id)
    assert caught.value.param == "response_id"
    foreground = client.responses.create(model=model, input="x")
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(foreground.id)


def test_delete(client: openai.OpenAI, model: str) -> None:
    """Deleting a response makes every later read of it a 404."""
    response = client.responses.create(model=model, input="to delete")
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(response.id)


def test_delete_cancels_a_live_background_response(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Deleting a running background response stops its upstream call and removes it."""
    upstream.script(model, {"text": " ".join(["word"] * 200), "delay": 0.1})
    created = client.responses.create(model=model, input="long", background=True)
    until_status(client, created.id, "in_progress")
    client.responses.delete(created.id)
    assert upstream.stats(until_active=0)["active"] == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_input_items_page_by_cursor(client: openai.OpenAI, model: str, order: str) -> None:
    """input_items pages with `after` in both orders; the SDK's auto-pagination visits every item once."""
    texts = [f"message {n}" for n in range(7)]
    response = client.responses.create(model=model, input=[{"role": "user", "content": t} for t in texts])
    first = client.responses.input_items.list(response.id, limit=3, order=order)  # type: ignore[arg-type]
    assert first.has_more is True and len(first.data) == 3
    seen = [
        item.content[0].text for item in client.responses.input_items.list(response.id, limit=3, order=order)
    ]  # type: ignore[union-attr,arg-type]
    assert seen == (texts if order == "asc" else texts[::-1])
    default = client.responses.input_items.list(response.id)
    assert default.data[0].content[0].text == "message 6"  # type: ignore[union-attr]
    assert default.has_more is False


def test_three_turn_chain_sends_every_turn_upstream(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """With previous_response_id, the upstream receives all earlier inputs and outputs, in order."""
    first = client.responses.create(model=model, input="one")
    second = client.responses.create(model=model, input="two", previous_response_id=first.id)
    third = client.responses.create(
        model=model, input="three", previous_response_id=second.id, instructions="be brief"
    )
    assert third.previous_response_id == second.id
    sent = upstream.requests(model)[-1]["messages"]
    assert [
        (m["role"], m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]) for m in sent
    ] == [
        ("system", "be brief"),
        ("user", "one"),
        ("assistant", ECHO + "one"),
        ("user", "two"),
        ("assistant", ECHO + "two"),
        ("user", "three"),
    ]


def test_unknown_previous_response_is_rejected(client: openai.OpenAI, model: str) -> None:
    """An unknown previous_response_id is a 400 previous_response_not_found (PROTOCOL.md §10)."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="x", previous_response_id="resp_doesnotexist")
    assert (caught.value.code, caught.value.param) == ("previous_response_not_found", "previous_response_id")


def test_native_upstream(client: openai.OpenAI, upstream: ScriptedUpstream) -> None:
    """A model routed to a Responses upstream runs natively: store=false upstream, respool's own ids."""
    response = client.responses.create(model=NATIVE_MODEL, input="native")
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == ECHO + "native"
    sent = upstream.requests(NATIVE_MODEL)[-1]
    assert (sent["path"], sent["store"], sent["stream"]) == ("/v1/responses", False, True)


def test_synthetic_model_needs_no_upstream(client: openai.OpenAI) -> None:
    """The built-in synthetic model answers deterministically."""
    response = client.responses.create(model="synthetic", input="Hello!")
    assert response.output_text == 'This is respool\'s synthetic model. You said: "Hello!"'


def test_models_lists_what_is_routed(client: openai.OpenAI) -> None:
    """GET /v1/models lists the synthetic model and the configured ones."""
    assert {"synthetic", NATIVE_MODEL} <= {model.id for model in client.models.list()}


def test_upstream_error_fails_the_response(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """An upstream 400 ends the response `failed` with the upstream's message, not an HTTP 5xx."""
    upstream.script(
        model, {"status": 400, "error": {"message": "context too long", "type": "invalid_request_error"}}
    )
    response = client.responses.create(model=model, input="x")
    assert response.status == "failed"
    assert response.error is not None and "context too long" in response.error.message


def test_a_nul_the_model_sends_becomes_the_replacement_character(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """Postgres can hold no NUL: the model's text is recorded with U+FFFD in its place, the same in
    the stream and the stored response, instead of failing the response."""
    upstream.script(model, {"text": "a\u0000b c"})
    with client.responses.create(model=model, input="x", stream=True) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
    assert deltas == "a\ufffdb c"
    created = client.responses.create(model=model, input="x", background=True)
    stored = until_status(client, created.id, "completed", "failed")
    assert (stored.status, stored.output_text) == ("completed", "a\ufffdb c")
