"""The SSE `error` frame that ends a stream the live tail lost (api/sse.py, `error_frame`;
worker/service/tailer.py, `TailLostError`). Unit tests, no network."""

from __future__ import annotations

import json

import pydantic
import pytest
from openai.types.responses import ResponseErrorEvent

from api.sse import error_frame
from tests.support.schema import validate_event
from worker.outages import as_unavailable, is_redis_outage
from worker.service.tail_outage import TailLostError

UNREACHABLE = "Redis was unreachable for 61 s, longer than this server waits for it (60 s, RESPOOL_REDIS_OUTAGE_SECONDS)."
LOST = "Redis came back without this response's events (it lost its data)."


def _parsed(lost: TailLostError, after: int) -> ResponseErrorEvent:
    error = as_unavailable(lost)
    assert error is not None
    head, data = error_frame(error, after, lost).decode().removesuffix("\n\n").split("\n")
    assert head == "event: error"
    event = json.loads(data.removeprefix("data: "))
    validate_event(event)
    return pydantic.TypeAdapter(ResponseErrorEvent).validate_python(event, strict=True)


def test_a_lost_tail_is_a_redis_outage_at_the_boundary() -> None:
    """Either end of the tail is an outage of Redis: a 503 with `retry-after` where it is answered."""
    assert is_redis_outage(TailLostError(LOST, is_resumable=False))


@pytest.mark.parametrize("after", [0, 41])
def test_an_outage_past_the_bound_names_its_seconds_and_where_to_resume(after: int) -> None:
    """The frame after an outage past the bound says how long Redis was away and where to resume."""
    parsed = _parsed(TailLostError(UNREACHABLE, is_resumable=True), after)
    assert (parsed.sequence_number, parsed.code) == (after, "service_unavailable")
    assert UNREACHABLE in parsed.message
    assert f"stream=true&starting_after={after}" in parsed.message


def test_a_stream_redis_lost_says_so_and_offers_no_resume() -> None:
    """The frame of a stream Redis lost says so and points at the Response, with no cursor to
    resume from (its events are gone: a resume would be a 400)."""
    parsed = _parsed(TailLostError(LOST, is_resumable=False), 17)
    assert parsed.sequence_number == 17
    assert LOST in parsed.message and "retrieve the response by id" in parsed.message
    assert "starting_after" not in parsed.message
